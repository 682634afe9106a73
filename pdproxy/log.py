"""Logging set-up: one stream handler, lazy %-formatting everywhere."""

from __future__ import annotations

import logging
from collections.abc import Callable

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=_FORMAT)


class RateLimitedLogger:
    """Logs a given key at most once per ``interval`` seconds, counting what it held back.

    For inputs a remote peer controls (registry floods): the log must not become the
    attacker's amplifier.
    """

    def __init__(
        self, logger: logging.Logger, clock: Callable[[], float], interval: float = 10.0
    ) -> None:
        self._logger = logger
        self._clock = clock
        self._interval = interval
        self._next: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: object) -> None:
        now = self._clock()
        if now < self._next.get(key, 0.0):
            self._held[key] = self._held.get(key, 0) + 1
            return
        held = self._held.pop(key, 0)
        suffix = f" ({held} similar messages suppressed)" if held else ""
        self._logger.warning(msg + suffix, *args)
        self._next[key] = now + self._interval
