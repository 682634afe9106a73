"""Distributed tracing; the only module that imports OpenTelemetry (the ``otel`` extra).

Off (no ``--otlp-traces-endpoint``), the ``NullTracer`` hands out shared null spans: no
span object, no header work, nothing imported. On, each client request gets a SERVER span
(a child of the client's own ``traceparent`` when it sent one) and each leg a CLIENT span
under it, whose W3C ``traceparent`` goes to the engine so vLLM's spans (``vllm serve
--otlp-traces-endpoint``) join the same trace. Spans leave through the SDK's batch
processor, which exports OTLP/HTTP protobuf from its own thread, off the event loop.

``--otlp-traces-endpoint`` is named as vLLM names it; as pdproxy speaks OTLP over HTTP
only, a URL without a path gets the collector's ``/v1/traces``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol
from urllib.parse import urlsplit

from pdproxy.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.trace import Span

AttributeValue = str | bool | int | float | Sequence[str]

_MISSING = (
    "--otlp-traces-endpoint needs OpenTelemetry, which is not installed: "
    "pip install 'pdproxy[otel]'"
)


class LegSpan(Protocol):
    def end(self, failure: str | None) -> None:
        """End the leg's span; ``failure`` names what went wrong, None when it succeeded."""
        ...


class RequestSpan(Protocol):
    def leg(self, role: str, url: str, headers: dict[str, str]) -> LegSpan:
        """Start a leg's span under this one and write its ``traceparent`` into ``headers``."""
        ...

    def end(self, attributes: Callable[[], Mapping[str, AttributeValue]]) -> None:
        """End the request's span with ``attributes()`` (only called when tracing is on)."""
        ...


class Tracer(Protocol):
    def start_request(self, path: str, headers: Mapping[str, str]) -> RequestSpan:
        """A client request's span; ``headers`` (lower-case names) may carry its parent."""
        ...

    def shutdown(self) -> None:
        """Flush what is buffered and stop; blocks (call it off the event loop)."""
        ...


class _NullLegSpan:
    def end(self, failure: str | None) -> None:
        pass


class _NullRequestSpan:
    def leg(self, role: str, url: str, headers: dict[str, str]) -> LegSpan:
        return NULL_LEG_SPAN

    def end(self, attributes: Callable[[], Mapping[str, AttributeValue]]) -> None:
        pass


# Stateless, so one of each serves every request.
NULL_LEG_SPAN = _NullLegSpan()
NULL_REQUEST_SPAN = _NullRequestSpan()


class NullTracer:
    def start_request(self, path: str, headers: Mapping[str, str]) -> RequestSpan:
        return NULL_REQUEST_SPAN

    def shutdown(self) -> None:
        pass


def require_otel() -> None:
    """Raise ``ConfigError`` unless the ``otel`` extra is installed."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise ConfigError(_MISSING) from exc


def traces_url(endpoint: str) -> str:
    """``endpoint`` as the OTLP/HTTP exporter wants it: a full URL to ``/v1/traces``."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(
            f"--otlp-traces-endpoint {endpoint!r}: give an http(s):// URL (OTLP over HTTP)"
        )
    return endpoint if parts.path.strip("/") else endpoint.rstrip("/") + "/v1/traces"


def load_tracer(endpoint: str | None) -> Tracer:
    """The tracer for ``--otlp-traces-endpoint``: null when it is not set."""
    if endpoint is None:
        return NullTracer()
    require_otel()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    return OtelTracer(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))


class OtelTracer:
    """Spans through an OpenTelemetry SDK provider of pdproxy's own (the process-global
    provider is left alone), ending in ``processor``. The service is ``$OTEL_SERVICE_NAME``,
    else ``service_name``; the exporter reads the other ``OTEL_EXPORTER_OTLP_*`` settings."""

    def __init__(self, processor: SpanProcessor, service_name: str = "pdproxy") -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        service = os.environ.get("OTEL_SERVICE_NAME") or service_name
        self._provider: TracerProvider = TracerProvider(
            resource=Resource.create({SERVICE_NAME: service})
        )
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("pdproxy")
        self._propagator = TraceContextTextMapPropagator()
        self._api = trace  # imported once, here, for the per-request calls

    def start_request(self, path: str, headers: Mapping[str, str]) -> RequestSpan:
        span = self._tracer.start_span(
            f"POST {path}",
            context=self._propagator.extract(headers),
            kind=self._api.SpanKind.SERVER,
            attributes={"http.request.method": "POST", "url.path": path},
        )
        return _OtelRequestSpan(self, span)

    def start_leg(self, parent: Span, role: str, url: str, headers: dict[str, str]) -> LegSpan:
        in_context = self._api.set_span_in_context
        span = self._tracer.start_span(
            f"{role} leg",
            context=in_context(parent),
            kind=self._api.SpanKind.CLIENT,
            attributes={"pdproxy.leg": role, "server.url": url},
        )
        self._propagator.inject(headers, context=in_context(span))
        return _OtelLegSpan(self, span)

    def end(self, span: Span, failure: str | None) -> None:
        if failure is not None:
            span.set_attribute("error.type", failure)
            span.set_status(self._api.Status(self._api.StatusCode.ERROR, failure))
        span.end()

    def shutdown(self) -> None:
        self._provider.shutdown()


class _OtelRequestSpan:
    __slots__ = ("_span", "_tracer")

    def __init__(self, tracer: OtelTracer, span: Span) -> None:
        self._tracer = tracer
        self._span = span

    def leg(self, role: str, url: str, headers: dict[str, str]) -> LegSpan:
        return self._tracer.start_leg(self._span, role, url, headers)

    def end(self, attributes: Callable[[], Mapping[str, AttributeValue]]) -> None:
        values = attributes()
        self._span.set_attributes(values)
        outcome = values.get("pdproxy.outcome")
        self._tracer.end(self._span, None if outcome == "ok" else str(outcome))


class _OtelLegSpan:
    __slots__ = ("_span", "_tracer")

    def __init__(self, tracer: OtelTracer, span: Span) -> None:
        self._tracer = tracer
        self._span = span

    def end(self, failure: str | None) -> None:
        self._tracer.end(self._span, failure)
