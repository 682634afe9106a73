"""OpenTelemetry on: one request through a real pdproxy (uvicorn on loopback) in front of a
sim PD pair yields a request span and both leg spans in one trace, and both engines
received that trace in ``traceparent`` (the client's own trace, when it sent one). Then
the same through a real OTLP/HTTP export to a receiver this test runs."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
from aiohttp import web

pytest.importorskip("opentelemetry.sdk", reason="the otel extra is not installed")

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind

from engines.ports import free_port
from engines.sim import SimConfig, running_sim
from pdproxy.config.proxy import ProxyConfig
from pdproxy.observability.tracing import OtelTracer
from pdproxy.types import EngineAddress
from tests.integration.conftest import MODEL
from tests.servers import running_proxy

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
BODY = {"model": MODEL, "prompt": "follow me", "max_tokens": 4, "stream": True}


@contextlib.asynccontextmanager
async def _pd_pair():
    async with (
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        running_sim(SimConfig(role="decode", model=MODEL)) as d,
    ):
        yield p, d


def _config(p, d, **extra) -> ProxyConfig:
    return ProxyConfig(
        prefill=(EngineAddress(url=p.url),), decode=(EngineAddress(url=d.url),), **extra
    )


async def _post(url: str, headers: dict[str, str] | None = None) -> int:
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/completions", json=BODY, headers=headers) as r,
    ):
        await r.read()
        return r.status


def _traceparent(sim) -> tuple[str, str]:
    """(trace id, parent span id) of the traceparent the sim's last generation carried."""
    version, trace_id, span_id, _flags = (
        sim.generation_requests()[-1].headers["traceparent"].split("-")
    )
    assert version == "00"
    return trace_id, span_id


async def _until(condition, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("timed out")


async def test_request_and_leg_spans_join_the_clients_trace_and_reach_both_engines():
    exporter = InMemorySpanExporter()
    tracer = OtelTracer(SimpleSpanProcessor(exporter))
    async with _pd_pair() as (p, d), running_proxy(_config(p, d), tracer=tracer) as proxy:
        parent = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
        assert await _post(proxy.url, parent) == 200
        await _until(lambda: len(exporter.get_finished_spans()) == 3)
        spans = {span.name: span for span in exporter.get_finished_spans()}
        request, prefill, decode = (
            spans[n] for n in ("POST /v1/completions", "prefill leg", "decode leg")
        )
        assert {format(s.context.trace_id, "032x") for s in spans.values()} == {CLIENT_TRACE}
        assert format(request.parent.span_id, "016x") == CLIENT_SPAN
        assert request.kind is SpanKind.SERVER and prefill.kind is decode.kind is SpanKind.CLIENT
        assert prefill.parent.span_id == decode.parent.span_id == request.context.span_id
        assert _traceparent(p) == (CLIENT_TRACE, format(prefill.context.span_id, "016x"))
        assert _traceparent(d) == (CLIENT_TRACE, format(decode.context.span_id, "016x"))
        attributes = request.attributes
        assert (
            attributes["pdproxy.outcome"] == "ok" and attributes["http.response.status_code"] == 200
        )
        assert (
            attributes["pdproxy.prefill.url"] == p.url and attributes["pdproxy.decode.url"] == d.url
        )
        assert (
            attributes["pdproxy.request_id"] == d.generation_requests()[-1].headers["x-request-id"]
        )
        assert prefill.attributes["server.url"] == p.url and decode.status.is_ok


async def test_tracing_off_sends_no_traceparent():
    async with _pd_pair() as (p, d), running_proxy(_config(p, d)) as proxy:
        assert await _post(proxy.url) == 200
        assert all(
            "traceparent" not in r.headers
            for r in p.generation_requests() + d.generation_requests()
        )


@contextlib.asynccontextmanager
async def _otlp_receiver():
    """A collector's OTLP/HTTP endpoint: keeps every ``POST /v1/traces`` body."""
    bodies: list[bytes] = []

    async def traces(request: web.Request) -> web.Response:
        bodies.append(await request.read())
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", bodies
    finally:
        await runner.cleanup()


def _exported(bodies: list[bytes]) -> tuple[list, set[str]]:
    """(spans, service names) of every export request received."""
    spans, services = [], set()
    for body in bodies:
        for resource_spans in ExportTraceServiceRequest.FromString(body).resource_spans:
            for attribute in resource_spans.resource.attributes:
                if attribute.key == "service.name":
                    services.add(attribute.value.string_value)
            for scope in resource_spans.scope_spans:
                spans.extend(scope.spans)
    return spans, services


async def test_spans_are_exported_over_otlp_http():
    async with _otlp_receiver() as (collector, bodies), _pd_pair() as (p, d):
        config = _config(p, d, otlp_traces_endpoint=collector)  # no path: /v1/traces is added
        async with running_proxy(config) as proxy:
            assert await _post(proxy.url) == 200
        # the proxy's shutdown flushed its batch
        spans, services = _exported(bodies)
    assert services == {"pdproxy"}
    assert sorted(s.name for s in spans) == ["POST /v1/completions", "decode leg", "prefill leg"]
    trace_ids = {s.trace_id.hex() for s in spans}
    assert (
        len(trace_ids) == 1 and _traceparent(d)[0] in trace_ids and _traceparent(p)[0] in trace_ids
    )
