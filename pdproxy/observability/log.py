"""Logging set-up: one stream handler on stderr, lazy %-formatting everywhere.

Every record is stamped with the current client request's id (``RequestIdFilter``, from
``pdproxy.observability.request_context``), so a line logged anywhere while a request is served, in
pdproxy or in a library, names it. ``--log-format`` picks the rendering: ``text`` appends
the id (and any structured fields) to the classic line; ``json`` writes one JSON object a
line with ``ts``, ``level``, ``logger``, ``msg``, ``request_id``, the fields, and
``exc_info`` when an exception is logged. uvicorn's loggers propagate to the same handler.

Structured fields ride on a record as ``extra={"fields": {...}}`` (the access line does).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Any

from pdproxy.observability.request_context import current_request_id

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
ACCESS_LOGGER = "pdproxy.access"


class RequestIdFilter(logging.Filter):
    """Sets ``record.request_id``: the current request's id, or None outside a request."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current_request_id()
        return True


def _text_value(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class TextFormatter(logging.Formatter):
    """``ts LEVEL logger: message k=v ... request_id=ID``."""

    def __init__(self) -> None:
        super().__init__(_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields: Mapping[str, Any] | None = getattr(record, "fields", None)
        if fields:
            line += "".join(f" {k}={_text_value(v)}" for k, v in fields.items())
        request_id = getattr(record, "request_id", None)
        return line if request_id is None else f"{line} request_id={request_id}"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            "request_id": getattr(record, "request_id", None),
        }
        fields: Mapping[str, Any] | None = getattr(record, "fields", None)
        if fields:
            for key, value in fields.items():
                line.setdefault(key, value)  # never over a base key
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc_info"] = record.exc_text
        if record.stack_info:
            line["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str, separators=(",", ":"))


# --log-format name -> formatter (names in pdproxy.config.proxy.LOG_FORMATS)
FORMATTERS: Mapping[str, Callable[[], logging.Formatter]] = MappingProxyType(
    {"text": TextFormatter, "json": JsonFormatter}
)


def log_handler(log_format: str = "text") -> logging.Handler:
    """A stderr handler rendering ``log_format`` with request ids stamped."""
    handler = logging.StreamHandler()
    handler.setFormatter(FORMATTERS[log_format]())
    handler.addFilter(RequestIdFilter())
    return handler


class AccessHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The access line's own handler: the line the formatters above would write, built in
    one step. It is the one line every request writes, and ``logging.Formatter``'s
    general path (``asctime`` through ``strftime``, ``%`` formatting, a second pass for the
    fields) cost about as much as the rest of the request's bookkeeping together; the
    timestamp is formatted once per second here."""

    def __init__(self, log_format: str) -> None:
        super().__init__()
        self._json = log_format == "json"
        self._second = -1
        self._stamp = ""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.stream.write(self._line(record))
            self.flush()
        except Exception:
            self.handleError(record)

    def _line(self, record: logging.LogRecord) -> str:
        fields: Mapping[str, Any] = getattr(record, "fields", None) or {}
        request_id = current_request_id()
        stamp = self._time(record.created)
        if self._json:
            line = {
                "ts": stamp,
                "level": record.levelname,
                "logger": record.name,
                "msg": record.getMessage(),
                "request_id": request_id,
                **fields,
            }
            return json.dumps(line, default=str, separators=(",", ":")) + "\n"
        pairs = "".join(
            [
                f" {k}={'-' if v is None else 'true' if v is True else 'false' if v is False else v}"  # noqa: E501
                for k, v in fields.items()
            ]
        )
        tail = "" if request_id is None else f" request_id={request_id}"
        head = f"{stamp} {record.levelname} {record.name}: {record.getMessage()}"
        return f"{head}{pairs}{tail}\n"

    def _time(self, created: float) -> str:
        second = int(created)
        if second != self._second:
            self._second = second
            if self._json:
                moment = datetime.fromtimestamp(second, timezone.utc)
                self._stamp = moment.strftime("%Y-%m-%dT%H:%M:%S")
            else:
                self._stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
        millis = int((created - second) * 1000)
        if self._json:
            return f"{self._stamp}.{millis:03d}+00:00"
        return f"{self._stamp},{millis:03d}"


def configure_logging(level: str, log_format: str = "text") -> None:
    logging.basicConfig(level=level.upper(), handlers=[log_handler(log_format)])
    access = logging.getLogger(ACCESS_LOGGER)
    access.addHandler(AccessHandler(log_format))
    access.propagate = False  # written once, by its own handler


class RateLimitedLogger:
    """Logs a given key at most once per ``interval`` seconds, counting what it held back.

    For inputs a remote peer controls (registry floods, a shared registry's keys): the log
    must not become the attacker's amplifier, nor its memory. At most ``max_keys`` keys are
    remembered; when a new key finds the table full, the keys whose interval has passed are
    forgotten, and if none has, the new key shares one overflow key with every other newcomer
    (still logged at most once per interval).
    """

    OVERFLOW = "\x00overflow"

    def __init__(
        self,
        logger: logging.Logger,
        clock: Callable[[], float],
        interval: float = 10.0,
        max_keys: int = 1024,
    ) -> None:
        self._logger = logger
        self._clock = clock
        self._interval = interval
        self._max_keys = max_keys
        self._next: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: object) -> None:
        now = self._clock()
        if key not in self._next and len(self._next) >= self._max_keys:
            key = self._make_room(now, key)
        if now < self._next.get(key, 0.0):
            self._held[key] = self._held.get(key, 0) + 1
            return
        held = self._held.pop(key, 0)
        suffix = f" ({held} similar messages suppressed)" if held else ""
        self._logger.warning(msg + suffix, *args)
        self._next[key] = now + self._interval

    def _make_room(self, now: float, key: str) -> str:
        """Forget the keys past their interval (and with nothing held back); the key to use."""
        for old in [k for k, due in self._next.items() if due <= now and k not in self._held]:
            del self._next[old]
        return key if len(self._next) < self._max_keys else self.OVERFLOW
