"""The two legs of one transfer over HTTP: each counted on its endpoint while it runs and
judged once (``Verdicts``) when it ends.

The prefill leg is clamped and read whole within ``--prefill-timeout-secs``; a non-2xx
answer raises and no decode is sent. The decode leg's status, and for a stream its first
bytes, are checked before anything reaches the client, so any failure up to then raises
an ``UpstreamError`` the orchestrator may still retry. Concurrent connectors run both legs
at once; a failed prefill aborts the waiting decode so a client never waits on KV that
cannot come. A leg whose request cannot be built (a header the instance's registration
made unsendable) fails as ``UpstreamRequestError`` against that instance: nothing was sent,
so it is retried elsewhere like a connect failure.

Each leg is counted through ``leg_counts``, the one writer of an instance's ``LegCounts``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from pdproxy.config.upstream import Timeouts
from pdproxy.connectors import KVConnector, Transfer
from pdproxy.errors import (
    ProxyError,
    UpstreamProtocolError,
    UpstreamServerError,
    UpstreamStatusError,
)
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.observability.request_context import RequestTrace, current
from pdproxy.observability.tracing import LegSpan
from pdproxy.proxying.exchange import ClientRequest, ProxyResponse
from pdproxy.proxying.leg_bracket import LegBracket
from pdproxy.proxying.leg_counts import read_from
from pdproxy.proxying.leg_faults import at_fault, unbuildable
from pdproxy.proxying.relay import ClientStream, StreamRelay
from pdproxy.proxying.watchdog import StreamWatchdog
from pdproxy.types import Endpoint, PairDecision
from pdproxy.upstream.engine_client import EngineClient, UpstreamResponse
from pdproxy.wire.kv_params import KV_TRANSFER_PARAMS
from pdproxy.wire.shaping import decode_body, is_streaming, leg_headers

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LegSize:
    """A prefill leg as the scheduler counts it while it runs: ``weight`` requests of
    typical size (``SpeedTracker.weight``) and ``tokens`` prompt tokens to compute (its
    prompt less its predicted hit)."""

    weight: float = 1.0
    tokens: float = 0.0


class Legs:
    def __init__(
        self,
        *,
        connector: KVConnector,
        client: EngineClient,
        timeouts: Timeouts,
        bracket: LegBracket,
        metrics: ProxyMetrics,
        kv_check: Callable[[PairDecision, Mapping[str, Any]], tuple[int, int] | None] | None = None,
    ) -> None:
        self._bracket = bracket
        # kv-events: the prefill's reported hit against the prediction (None: policy off)
        self._kv_check = kv_check
        self._connector = connector
        self._client = client
        self._timeouts = timeouts
        self._verdicts = bracket.verdicts
        self._metrics = metrics
        self._background: set[asyncio.Task[Any]] = set()
        self._watchdog = StreamWatchdog(
            client.read_timeout,
            max_event=client.stream_limits[0],
            max_stream=client.stream_limits[1],
        )

    @property
    def watchdog(self) -> StreamWatchdog:
        """The one watchdog of every stream the legs relay."""
        return self._watchdog

    def start(self) -> None:
        self._watchdog.start()

    def abort_streams(self, origin: str, failure: ProxyError) -> int:
        """End every stream read from the decode ``origin`` with ``failure``."""
        return self._watchdog.abort_from(origin, failure)

    async def aclose(self) -> None:
        await cancel(*self._background)
        await self._watchdog.aclose()

    async def prefill(
        self, request: ClientRequest, transfer: Transfer, size: LegSize = LegSize()
    ) -> dict[str, Any]:
        """Run the clamped prefill leg and return P's answer; ``size`` is how the scheduler
        counts it while it runs (``LegCounts.work`` and ``queued_tokens``)."""
        endpoint = transfer.decision.prefill
        rank = transfer.decision.prefill_dp_rank
        body = orjson.dumps(self._connector.prefill_body(request.body, transfer))
        headers = leg_headers(transfer.request_id, request.authorization, rank, request.via)
        trace = current()
        span = trace.prefill_started(transfer.request_id, endpoint.url, rank, headers)
        started = time.perf_counter()
        self._bracket.open(endpoint, rank, size.weight, size.tokens)
        try:
            try:
                upstream = await self._client.post(
                    endpoint.url + request.kind.path,
                    body,
                    headers,
                    leg="prefill",
                    stream=False,
                    within=self._timeouts.prefill,
                )
            except ValueError as exc:  # http1 builds the head before anything is sent
                raise unbuildable(endpoint, transfer.decision) from exc
            answer = _prefill_answer(upstream, await upstream.read_all())
        except ProxyError as error:
            self._bracket.failed(at_fault(error, endpoint, transfer.decision), error, span, trace)
            self._connector.prefill_failed(transfer.decision)
            raise
        except BaseException:
            self._bracket.abandoned(endpoint, span)
            raise
        finally:
            self._bracket.close(endpoint, rank, size.weight, size.tokens)
            trace.prefill_ended = ended = time.perf_counter()
        self._metrics.prefill_seconds.observe(ended - started)
        trace.prefill_answered = ended
        span.end(None)
        self._verdicts.success(endpoint)
        self._connector.observe_prefill(transfer.decision, answer)
        if self._kv_check is not None:
            self._checked(self._kv_check(transfer.decision, answer))
        return answer

    def _checked(self, figures: tuple[int, int] | None) -> None:
        if figures is not None:
            predicted, actual = figures
            self._metrics.kv_events_cached_tokens.labels("predicted").inc(predicted)
            self._metrics.kv_events_cached_tokens.labels("actual").inc(actual)
            self._metrics.kv_events_error_tokens.inc(abs(predicted - actual))

    def count_failure(self, endpoint: Endpoint, reason: str) -> None:
        """A leg of ``endpoint`` answered what cannot be trusted (it was not an error on
        the wire): counted toward its ejection as a failed leg, its success undone."""
        self._verdicts.untrusted(endpoint, reason)

    def prepare_decode(self, request: ClientRequest, decode: Endpoint) -> None:
        """While prefills run, a connection ready for each decode leg waiting on one there
        (``legs.reserved``): the decode is sent the moment its prefill answers, not after
        a connect (the first requests after an idle spell find none pooled)."""
        self._client.prepare(decode.url + request.kind.path, decode.legs.reserved)

    async def decode(
        self,
        request: ClientRequest,
        transfer: Transfer,
        prefill_answer: Mapping[str, Any] | None,
        headers_within: float | None = None,
    ) -> ProxyResponse:
        """Open the decode leg; its status (and a stream's first bytes) are checked before
        the client's response starts. ``headers_within`` replaces the decode header timeout
        (a concurrent push's decode answers only once its prefill wrote the KV)."""
        body = self._connector.decode_body(request.body, transfer, prefill_answer)
        if prefill_answer is not None and KV_TRANSFER_PARAMS not in prefill_answer:
            self._metrics.kv_params_missing.inc()
        decision = transfer.decision
        rank = decision.decode_dp_rank if self._connector.routes_decode_rank else None
        leg = _DecodeLeg(
            decision.decode, rank, transfer.request_id, prefill_answer, decision, headers_within
        )
        return await self._open(request, leg, body)

    async def single(
        self, request: ClientRequest, decode: Endpoint, request_id: str, rank: int | None
    ) -> ProxyResponse:
        """A decode-only request: the client's body as a plain request (no KV params, the
        client's own stripped), checked like a decode leg."""
        current().decode_only = True
        leg = _DecodeLeg(decode, rank, request_id, None)
        return await self._open(request, leg, decode_body(request.body, None))

    async def _open(
        self, request: ClientRequest, leg: _DecodeLeg, body: Mapping[str, Any]
    ) -> ProxyResponse:
        endpoint, rank = leg.endpoint, leg.rank
        headers = leg_headers(leg.request_id, request.authorization, rank, request.via)
        trace = current()
        span = trace.decode_started(leg.request_id, endpoint.url, headers)
        streaming = is_streaming(request.body)
        self._bracket.open(endpoint, rank)
        try:
            try:
                upstream = await self._client.post(
                    endpoint.url + request.kind.path,
                    orjson.dumps(body),
                    headers,
                    leg="decode",
                    stream=streaming,
                    headers_within=leg.headers_within or self._timeouts.decode_headers,
                )
            except ValueError as exc:  # http1 builds the head before anything is sent
                raise unbuildable(endpoint, leg.pair) from exc
            self._headers_arrived(trace, upstream.status < 300 and streaming)
            if streaming and upstream.status < 300:
                return await self._stream(upstream, leg, span, trace)
            response = _whole_answer(upstream, await upstream.read_all(), leg.request_id)
        except ProxyError as error:
            self._bracket.close(endpoint, rank)
            self._bracket.failed(at_fault(error, endpoint, leg.pair), error, span, trace)
            raise
        except BaseException:
            self._bracket.close(endpoint, rank)
            self._bracket.abandoned(endpoint, span)
            raise
        self._bracket.close(endpoint, rank)
        self._succeeded(endpoint, leg.prefill_answer)
        span.end(None)
        return response

    def _headers_arrived(self, trace: RequestTrace, streamed: bool) -> None:
        """The decode's headers are here; a stream's wait for them is observed."""
        trace.decode_headers = now = time.perf_counter()
        if streamed and trace.decode_sent is not None:
            self._metrics.decode_headers_seconds.observe(now - trace.decode_sent)

    def _succeeded(self, decode: Endpoint, prefill_answer: Mapping[str, Any] | None) -> None:
        self._verdicts.success(decode)
        source = self._connector.kv_source(prefill_answer) if prefill_answer else None
        if source is not None:
            read_from(decode, source)

    async def _stream(
        self, upstream: UpstreamResponse, leg: _DecodeLeg, span: LegSpan, trace: RequestTrace
    ) -> ProxyResponse:
        """Wait for the stream's first bytes; from then on the relay owns the leg (and
        uncounts it when it closes). Raises with the leg uncounted."""
        relay = StreamRelay(upstream, lambda: None, self._watchdog)
        relay.origin = leg.endpoint.url
        try:
            await relay.prime()
        except BaseException:
            relay.close()
            raise
        if leg.prefill_answer is not None and trace.prefill_answered is not None:
            # Serial legs: P answered, then D read the KV and made its first token.
            self._metrics.kv_handoff_seconds.observe(time.perf_counter() - trace.prefill_answered)
        relay.when_closed(lambda: self._stream_closed(leg, relay, span))
        self._succeeded(leg.endpoint, leg.prefill_answer)
        return ProxyResponse(200, "text/event-stream", leg.request_id, stream=relay)

    def _stream_closed(self, leg: _DecodeLeg, relay: StreamRelay, span: LegSpan) -> None:
        self._bracket.stream_closed(leg.endpoint, leg.rank, relay.failure, "decode", span)

    async def concurrent(
        self, request: ClientRequest, transfer: Transfer, size: LegSize = LegSize()
    ) -> ProxyResponse:
        """Send P and D together (push/WRITE transfers); a failed P aborts D."""
        prefill = asyncio.create_task(self.prefill(request, transfer, size))
        decode = asyncio.create_task(self.decode(request, transfer, None))
        try:
            await asyncio.wait((prefill, decode), return_when=asyncio.FIRST_COMPLETED)
            if prefill.done():
                prefill.result()  # re-raises a failed prefill before waiting on the decode
            response = await decode
        except BaseException:
            await cancel(prefill, decode)
            raise
        if response.stream is not None:
            self._watch_prefill(prefill, response.stream)
        elif not prefill.done():
            self._keep(prefill)
        return response

    def _watch_prefill(self, prefill: asyncio.Task[Any], relay: ClientStream) -> None:
        """Abort the relay if P fails after D's stream has started."""

        def on_done(task: asyncio.Task[Any]) -> None:
            error = None if task.cancelled() else task.exception()
            if isinstance(error, ProxyError):
                relay.abort(error)

        prefill.add_done_callback(on_done)
        self._keep(prefill)

    def _keep(self, task: asyncio.Task[Any]) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_consume_result)


@dataclass(frozen=True, slots=True)
class _DecodeLeg:
    endpoint: Endpoint
    rank: int | None
    request_id: str
    prefill_answer: Mapping[str, Any] | None
    pair: PairDecision | None = None  # None: a decode-only request
    headers_within: float | None = None  # None: --decode-header-timeout-secs


def _prefill_answer(upstream: UpstreamResponse, data: bytes) -> dict[str, Any]:
    if upstream.status >= 500:
        raise UpstreamServerError(leg="prefill", status=upstream.status)
    if upstream.status >= 300:
        raise UpstreamStatusError(
            leg="prefill", status=upstream.status, body=data, content_type=upstream.content_type
        )
    try:
        answer = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise UpstreamProtocolError(
            "prefill engine answered with invalid JSON", leg="prefill"
        ) from exc
    if not isinstance(answer, dict):
        raise UpstreamProtocolError("prefill engine answered with a non-object", leg="prefill")
    return answer


def _whole_answer(upstream: UpstreamResponse, data: bytes, request_id: str) -> ProxyResponse:
    if upstream.status >= 300:
        raise UpstreamStatusError(
            leg="decode", status=upstream.status, body=data, content_type=upstream.content_type
        )
    return ProxyResponse(upstream.status, upstream.content_type, request_id, body=data)


def _consume_result(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.debug("background prefill ended with %r", task.exception())


async def cancel(*tasks: asyncio.Task[Any]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
