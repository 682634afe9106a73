"""Tracing off costs nothing; on, it needs the otel extra, and says so at start-up."""

from __future__ import annotations

import sys

import pytest

from pdproxy.cli.main import parse_config
from pdproxy.errors import ConfigError
from pdproxy.observability.request_context import RequestTrace
from pdproxy.observability.tracing import (
    NULL_LEG_SPAN,
    NULL_REQUEST_SPAN,
    NullTracer,
    load_tracer,
    traces_url,
)

FLEET = ["--prefill", "a:1", "--decode", "b:2"]


def test_off_means_shared_null_spans_and_no_header_work():
    tracer = load_tracer(None)
    assert isinstance(tracer, NullTracer)
    span = tracer.start_request(
        "/v1/completions", {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    )
    assert span is NULL_REQUEST_SPAN
    headers = {"X-Request-Id": "r"}
    trace = RequestTrace("/v1/completions")
    assert trace.prefill_started("r", "http://p:1", None, headers) is NULL_LEG_SPAN
    assert headers == {"X-Request-Id": "r"}
    trace.span.end(lambda: pytest.fail("attributes built with tracing off"))


@pytest.mark.parametrize(
    ("given", "url"),
    [
        ("http://collector:4318", "http://collector:4318/v1/traces"),
        ("http://collector:4318/", "http://collector:4318/v1/traces"),
        ("https://c.example/otlp/v1/traces", "https://c.example/otlp/v1/traces"),
    ],
)
def test_traces_url(given, url):
    assert traces_url(given) == url


@pytest.mark.parametrize("bad", ["grpc://collector:4317", "collector:4318", "http://"])
def test_a_non_http_endpoint_is_refused(bad, capsys):
    with pytest.raises(ConfigError):
        traces_url(bad)
    with pytest.raises(SystemExit) as exit_:
        parse_config([*FLEET, "--otlp-traces-endpoint", bad], {})
    assert exit_.value.code == 2 and "OTLP over HTTP" in capsys.readouterr().err


def test_without_the_extra_start_up_fails_with_the_install_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if not installed
    with pytest.raises(SystemExit) as exit_:
        parse_config([*FLEET, "--otlp-traces-endpoint", "http://127.0.0.1:4318"], {})
    assert exit_.value.code == 2
    assert "pip install 'pdproxy[otel]'" in capsys.readouterr().err
    assert parse_config(FLEET, {}).otlp_traces_endpoint is None  # off: nothing is imported


def test_logging_flags_reach_the_config():
    config = parse_config([*FLEET, "--log-format", "json", "--no-access-log"], {})
    assert (config.log_format, config.access_log) == ("json", False)
    assert parse_config(FLEET, {"PDPROXY_ACCESS_LOG": "false"}).access_log is False
    assert parse_config(FLEET, {}).access_log is True
