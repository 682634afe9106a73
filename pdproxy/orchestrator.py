"""One request's prefill/decode flow, free of any web framework.

schedule → connector fixes the ids → prefill leg (clamped, read whole) → decode leg (opened,
status checked before anything reaches the client) → relay. Serial connectors run P then D;
concurrent ones run both at once, and a failed P aborts the waiting D so a client never
waits on KV that cannot come.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from pdproxy.connectors import KVConnector, Transfer
from pdproxy.engine_client import EngineClient, UpstreamResponse
from pdproxy.errors import ProxyError, UpstreamProtocolError, UpstreamStatusError
from pdproxy.metrics import ProxyMetrics
from pdproxy.registry import EndpointRegistry
from pdproxy.relay import StreamRelay, StreamWatchdog
from pdproxy.scheduling import Scheduler
from pdproxy.shaping import is_streaming, leg_headers
from pdproxy.types import ApiKind, Endpoint

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ClientRequest:
    kind: ApiKind
    body: Mapping[str, Any]  # parsed once; never mutated
    request_id: str | None  # the client's X-Request-Id header, unvalidated
    authorization: str | None


@dataclass(slots=True)
class ProxyResponse:
    """What goes back to the client: a whole body, or a relay that must be closed."""

    status: int
    content_type: str
    request_id: str
    body: bytes = b""
    stream: StreamRelay | None = None


class Orchestrator:
    def __init__(
        self,
        *,
        registry: EndpointRegistry,
        scheduler: Scheduler,
        connector: KVConnector,
        client: EngineClient,
        metrics: ProxyMetrics,
    ) -> None:
        self._registry = registry
        self._scheduler = scheduler
        self._connector = connector
        self._client = client
        self._metrics = metrics
        self._background: set[asyncio.Task[Any]] = set()
        self._watchdog = StreamWatchdog(client.read_timeout)
        self._watchdog_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._watchdog_task = asyncio.create_task(self._watchdog.run())

    async def handle(self, request: ClientRequest) -> ProxyResponse:
        decision = self._scheduler.schedule(self._registry.snapshot())
        transfer = self._connector.begin(decision, request.request_id)
        logger.debug(
            "%s: prefill %s (dp rank %s), decode %s",
            transfer.request_id,
            decision.prefill.url,
            decision.prefill_dp_rank,
            decision.decode.url,
        )
        if self._connector.runs_concurrently(transfer):
            return await self._concurrent(request, transfer)
        prefill_answer = await self._prefill(request, transfer)
        return await self._decode(request, transfer, prefill_answer)

    async def _prefill(self, request: ClientRequest, transfer: Transfer) -> dict[str, Any]:
        """Run the clamped prefill leg; a non-2xx answer raises and no decode is sent."""
        endpoint = transfer.decision.prefill
        body = orjson.dumps(self._connector.prefill_body(request.body, transfer))
        headers = leg_headers(
            transfer.request_id, request.authorization, transfer.decision.prefill_dp_rank
        )
        started = time.perf_counter()
        with _in_flight(endpoint):
            upstream, data = await self._client.post_read(
                endpoint.url + request.kind.path, body, headers, leg="prefill"
            )
        self._metrics.prefill_seconds.observe(time.perf_counter() - started)
        if upstream.status >= 500:
            raise UpstreamProtocolError(
                f"prefill engine answered HTTP {upstream.status}", leg="prefill"
            )
        if upstream.status >= 300:
            raise UpstreamStatusError(
                leg="prefill", status=upstream.status, body=data, content_type=upstream.content_type
            )
        return _parse_prefill_answer(data)

    async def _decode(
        self, request: ClientRequest, transfer: Transfer, prefill_answer: Mapping[str, Any] | None
    ) -> ProxyResponse:
        """Open the decode leg and check its status before the client response starts."""
        endpoint = transfer.decision.decode
        body_dict = self._connector.decode_body(request.body, transfer, prefill_answer)
        if prefill_answer is not None and "kv_transfer_params" not in prefill_answer:
            self._metrics.kv_params_missing.inc()
        headers = leg_headers(transfer.request_id, request.authorization)
        streaming = is_streaming(request.body)
        endpoint.in_flight += 1
        relayed = False
        try:
            upstream = await self._client.post(
                endpoint.url + request.kind.path,
                orjson.dumps(body_dict),
                headers,
                leg="decode",
                stream=streaming,
            )
            if streaming and upstream.status < 300:
                relayed = True  # from here the relay uncounts the leg when it closes
                relay = StreamRelay(upstream, lambda: _release(endpoint), self._watchdog)
                return ProxyResponse(200, "text/event-stream", transfer.request_id, stream=relay)
            return _whole_answer(upstream, await upstream.read_all(), transfer.request_id)
        finally:
            if not relayed:
                _release(endpoint)

    async def _concurrent(self, request: ClientRequest, transfer: Transfer) -> ProxyResponse:
        """Send P and D together (push/WRITE transfers); a failed P aborts D."""
        prefill = asyncio.create_task(self._prefill(request, transfer))
        decode = asyncio.create_task(self._decode(request, transfer, None))
        try:
            await asyncio.wait((prefill, decode), return_when=asyncio.FIRST_COMPLETED)
            if prefill.done():
                prefill.result()  # re-raises a failed prefill before waiting on the decode
            response = await decode
        except BaseException:
            await _cancel(prefill, decode)
            raise
        if response.stream is not None:
            self._watch_prefill(prefill, response.stream)
        elif not prefill.done():
            self._keep(prefill)
        return response

    def _watch_prefill(self, prefill: asyncio.Task[Any], relay: StreamRelay) -> None:
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

    async def aclose(self) -> None:
        watchdog = [self._watchdog_task] if self._watchdog_task is not None else []
        await _cancel(*self._background, *watchdog)


def _parse_prefill_answer(data: bytes) -> dict[str, Any]:
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


class _in_flight:
    """Count a leg on its endpoint for exactly as long as the block runs."""

    def __init__(self, endpoint: Endpoint) -> None:
        self._endpoint = endpoint

    def __enter__(self) -> None:
        self._endpoint.in_flight += 1

    def __exit__(self, *exc: object) -> None:
        self._endpoint.in_flight -= 1


def _release(endpoint: Endpoint) -> None:
    endpoint.in_flight -= 1


def _consume_result(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.debug("background prefill ended with %r", task.exception())


async def _cancel(*tasks: asyncio.Task[Any]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
