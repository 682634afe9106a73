"""Pass-through requests: the client's request on ONE decode instance, no prefill, no KV
transfer (which endpoints, and why: ``pdproxy.wire.routes``).

pick (the decode policy over the usable decodes; a ``/v1/responses`` follow-up goes to the
instance its previous response is pinned to) → send the body as it came (a
``/v1/responses`` one named for that instance) → check the status, and a stream's first
bytes, before anything reaches the client → relay the answer whole, or the stream chunk by
chunk (``StreamRelay``; an engine that dies mid-stream ends it with one error event).

A failure before the client's response started is retried on another decode by the same
retry run as a decode leg (``Retries``): the same retry-safe reasons (``resilience.retry``),
``--max-retries`` per request, the fleet-wide retry budget shared with the generation
endpoints, backoff once every decode was tried. A pinned response is never retried
elsewhere: no other instance holds its conversation. The leg counts on its instance while it
runs and is judged once (``Verdicts``), like any decode leg; a leg whose request cannot be
built fails against its instance as nothing sent (``leg_faults.unbuildable``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from pdproxy.config.upstream import Timeouts
from pdproxy.errors import ProxyError, UpstreamError, UpstreamStatusError
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.observability.request_context import bind_request_id, current
from pdproxy.observability.tracing import LegSpan
from pdproxy.proxying.exchange import ProxyResponse
from pdproxy.proxying.framing import RESPONSES_SSE
from pdproxy.proxying.leg_bracket import LegBracket
from pdproxy.proxying.leg_faults import unbuildable
from pdproxy.proxying.relay import StreamRelay
from pdproxy.proxying.retries import Retries, RetryRun
from pdproxy.proxying.watchdog import StreamWatchdog
from pdproxy.resilience.outlier import OutlierDetector
from pdproxy.scheduling.context import RequestFeatures
from pdproxy.types import Endpoint, Role
from pdproxy.upstream.engine_client import EngineClient, UpstreamResponse
from pdproxy.wire.routes import PREVIOUS_RESPONSE_ID, PassthroughRoute, pinned, responses_body
from pdproxy.wire.shaping import MODEL, client_request_id, is_streaming, leg_headers

logger = logging.getLogger(__name__)

LEG = "decode"  # the leg label of its errors, retries and metrics: it runs on a decode
# Engine response headers a client needs besides the body: vLLM's binary embeddings
# (encoding_format "bytes") carry their shapes and usage in "metadata".
_RELAYED_HEADERS = ("metadata",)


@dataclass(frozen=True, slots=True)
class PassthroughRequest:
    route: PassthroughRoute
    body: Mapping[str, Any] | None  # parsed once (None for a GET); never mutated
    raw: bytes  # the body as it came, sent as it is unless it must be named
    request_id: str | None  # the client's X-Request-Id header, unvalidated
    authorization: str | None
    session: str | None = None  # the --session-header's value (consistent-hash key)
    via: str | None = None  # the Via its leg carries: the client's hops, then this pdproxy's


class Passthrough:
    def __init__(
        self,
        *,
        registry: EndpointRegistry,
        client: EngineClient,
        timeouts: Timeouts,
        bracket: LegBracket,
        outliers: OutlierDetector,
        retries: Retries,
        metrics: ProxyMetrics,
    ) -> None:
        self._registry = registry
        self._client = client
        self._timeouts = timeouts
        self._bracket = bracket
        self._verdicts = bracket.verdicts
        self._outliers = outliers
        # picks and retries among the decodes, or another pool (--render's servers)
        self._retries = retries
        self._metrics = metrics
        self._watchdog = StreamWatchdog(
            client.read_timeout,
            max_event=client.stream_limits[0],
            max_stream=client.stream_limits[1],
        )

    def start(self) -> None:
        self._watchdog.start()

    async def aclose(self) -> None:
        await self._watchdog.aclose()

    async def handle(self, request: PassthroughRequest) -> ProxyResponse:
        """The engine's answer (whole, or a primed stream the caller must close); raises
        ``ProxyError`` when no decode could answer."""
        run = RetryRun(_features(request), self._retries.begin())
        request_id = client_request_id(request.request_id)
        bind_request_id(request_id)
        home = self._home(request)
        pool = self._retries.pool(Role.DECODE, None)
        candidates = (home,) if home else self._outliers.usable(pool)
        endpoint, rank = self._retries.pick(run, Role.DECODE, candidates)
        try:
            return await self._send(request, endpoint, rank, request_id)
        except UpstreamError as exc:
            if home is not None:
                raise
            error = exc  # retried outside this handler: a later failure is not chained to it

        def attempt(endpoint: Endpoint, rank: int | None) -> Awaitable[ProxyResponse]:
            return self._send(request, endpoint, rank, request_id)

        return await self._retries.retry(run, Role.DECODE, endpoint, error, attempt)

    def _home(self, request: PassthroughRequest) -> Endpoint | None:
        """The routable decode a ``/v1/responses`` follow-up's conversation is pinned to."""
        if not request.route.responses or request.body is None:
            return None
        previous = request.body.get(PREVIOUS_RESPONSE_ID)
        return pinned(previous, self._registry.snapshot().decode)

    async def _send(
        self, request: PassthroughRequest, endpoint: Endpoint, rank: int | None, request_id: str
    ) -> ProxyResponse:
        """One leg; its status (and a stream's first bytes) are checked before the client's
        response starts. Raises with the leg uncounted."""
        route = request.route
        rank = rank if route.responses else None  # only vLLM's generation reads the header
        streaming = route.responses and request.body is not None and is_streaming(request.body)
        headers = leg_headers(request_id, request.authorization, rank, request.via)
        trace = current()
        span = trace.decode_started(request_id, endpoint.url, headers)
        self._bracket.open(endpoint, rank)
        try:
            try:
                upstream = await self._open(request, endpoint, headers, streaming)
            except ValueError as exc:  # http1 builds the head before anything is sent
                raise unbuildable(endpoint, None) from exc
            trace.decode_headers = time.perf_counter()
            if streaming and upstream.status < 300:
                return await self._stream(upstream, endpoint, rank, request_id, span)
            response = _whole_answer(upstream, await upstream.read_all(), request_id)
        except ProxyError as error:
            self._bracket.close(endpoint, rank)
            self._bracket.failed(endpoint, error, span, trace)
            raise
        except BaseException:
            self._bracket.close(endpoint, rank)
            self._bracket.abandoned(endpoint, span)
            raise
        self._bracket.close(endpoint, rank)
        self._verdicts.success(endpoint)
        span.end(None)
        return response

    async def _open(
        self,
        request: PassthroughRequest,
        endpoint: Endpoint,
        headers: dict[str, str],
        streaming: bool,
    ) -> UpstreamResponse:
        url = endpoint.url + request.route.path
        if request.route.method == "GET":
            del headers["Content-Type"]
            return await self._client.get(url, headers, leg=LEG)
        body = request.raw
        if request.route.responses and request.body is not None:
            body = orjson.dumps(responses_body(request.body, endpoint.url))
        if not streaming:
            return await self._client.post(url, body, headers, leg=LEG, stream=False)
        return await self._client.post(
            url, body, headers, leg=LEG, stream=True, headers_within=self._timeouts.decode_headers
        )

    async def _stream(
        self,
        upstream: UpstreamResponse,
        endpoint: Endpoint,
        rank: int | None,
        request_id: str,
        span: LegSpan,
    ) -> ProxyResponse:
        """Wait for the stream's first bytes; from then on the relay owns the leg (and
        uncounts it when it closes)."""
        relay = StreamRelay(upstream, lambda: None, self._watchdog, RESPONSES_SSE)
        try:
            await relay.prime()
        except BaseException:
            relay.close()
            raise
        relay.when_closed(lambda: self._stream_closed(endpoint, rank, relay, span))
        self._verdicts.success(endpoint)
        return ProxyResponse(200, upstream.content_type, request_id, stream=relay)

    def _stream_closed(
        self, endpoint: Endpoint, rank: int | None, relay: StreamRelay, span: LegSpan
    ) -> None:
        self._bracket.stream_closed(endpoint, rank, relay.failure, LEG, span)


def _features(request: PassthroughRequest) -> RequestFeatures:
    """What the decode policy sees: the model (for its model filter) and a session key
    (for consistent hashing: the session header, else the body's ``user``)."""
    body = request.body or {}
    model = body.get(MODEL)
    session = request.session
    if session is None:
        user = body.get("user")
        session = user if isinstance(user, str) and user else None
    return RequestFeatures(model=model if isinstance(model, str) else None, session=session)


def _whole_answer(upstream: UpstreamResponse, data: bytes, request_id: str) -> ProxyResponse:
    if upstream.status >= 300:
        raise UpstreamStatusError(
            leg=LEG, status=upstream.status, body=data, content_type=upstream.content_type
        )
    relayed = tuple(
        (name.encode("latin-1"), value.encode("latin-1"))
        for name in _RELAYED_HEADERS
        if (value := upstream.header(name)) is not None
    )
    return ProxyResponse(
        upstream.status, upstream.content_type, request_id, body=data, headers=relayed
    )
