"""Log rendering: the request id from the context, structured fields, JSON that parses."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from pdproxy.observability.log import FORMATTERS, JsonFormatter, RequestIdFilter, TextFormatter
from pdproxy.observability.request_context import RequestTrace, bind, bind_request_id, unbind


def _record(
    msg: str = "leg to %s", args: tuple = ("P",), exc_info=None, **extra
) -> logging.LogRecord:
    logger = logging.getLogger("pdproxy.test")
    record = logger.makeRecord(
        logger.name, logging.WARNING, __file__, 1, msg, args, exc_info, extra=extra
    )
    RequestIdFilter().filter(record)
    return record


def test_no_request_id_outside_a_request():
    record = _record()
    assert record.request_id is None
    assert TextFormatter().format(record).endswith("WARNING pdproxy.test: leg to P")
    assert json.loads(JsonFormatter().format(record))["request_id"] is None


def test_the_bound_requests_id_is_stamped_on_every_record():
    token = bind(RequestTrace("/v1/completions"))
    try:
        assert _record().request_id is None  # not fixed by the connector yet
        bind_request_id("req-1")
        record = _record()
    finally:
        unbind(token)
    assert record.request_id == "req-1"
    assert TextFormatter().format(record).endswith("leg to P request_id=req-1")
    assert _record().request_id is None  # unbound again


def test_json_line_has_the_base_keys_and_the_fields():
    record = _record(fields={"status": 200, "prefill_url": None, "decode_only": False})
    record.request_id = "req-2"
    line = json.loads(JsonFormatter().format(record))
    assert line == {
        "ts": line["ts"],
        "level": "WARNING",
        "logger": "pdproxy.test",
        "msg": "leg to P",
        "request_id": "req-2",
        "status": 200,
        "prefill_url": None,
        "decode_only": False,
    }
    assert line["ts"].endswith("+00:00") and "T" in line["ts"]


def test_text_line_renders_fields_as_key_values():
    record = _record("request finished", (), fields={"a": None, "b": True, "c": 1.5})
    assert TextFormatter().format(record).endswith("request finished a=- b=true c=1.5")


def test_json_line_carries_the_exception_and_stays_one_line():
    try:
        raise ValueError('bad "thing"\nacross lines')
    except ValueError:
        record = _record(exc_info=sys.exc_info())
    text = JsonFormatter().format(record)
    assert "\n" not in text
    line = json.loads(text)
    assert "ValueError" in line["exc_info"] and "Traceback" in line["exc_info"]


def test_fields_never_replace_a_base_key():
    record = _record(fields={"msg": "forged", "level": "DEBUG"})
    line = json.loads(JsonFormatter().format(record))
    assert (line["msg"], line["level"]) == ("leg to P", "WARNING")


@pytest.mark.parametrize("name", ["text", "json"])
def test_every_log_format_has_a_formatter(name):
    from pdproxy.config.proxy import LOG_FORMATS

    assert set(FORMATTERS) == set(LOG_FORMATS)
    assert isinstance(FORMATTERS[name](), logging.Formatter)
