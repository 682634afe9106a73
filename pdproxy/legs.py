"""The two legs of one transfer over HTTP: each counted on its endpoint while it runs and
judged once (``Verdicts``) when it ends.

The prefill leg is clamped and read whole within ``--prefill-timeout-secs``; a non-2xx
answer raises and no decode is sent. The decode leg's status, and for a stream its first
bytes, are checked before anything reaches the client, so any failure up to then raises
an ``UpstreamError`` the orchestrator may still retry. Concurrent connectors run both legs
at once; a failed prefill aborts the waiting decode so a client never waits on KV that
cannot come.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

import orjson

from pdproxy.config import Timeouts
from pdproxy.connectors import KVConnector, Transfer
from pdproxy.engine_client import EngineClient, UpstreamResponse
from pdproxy.errors import (
    ProxyError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamServerError,
    UpstreamStatusError,
)
from pdproxy.exchange import ClientRequest, ProxyResponse
from pdproxy.metrics import ProxyMetrics
from pdproxy.relay import StreamRelay, StreamWatchdog
from pdproxy.shaping import is_streaming, leg_headers
from pdproxy.types import Endpoint
from pdproxy.verdicts import Verdicts

logger = logging.getLogger(__name__)


class Legs:
    def __init__(
        self,
        *,
        connector: KVConnector,
        client: EngineClient,
        timeouts: Timeouts,
        verdicts: Verdicts,
        metrics: ProxyMetrics,
    ) -> None:
        self._connector = connector
        self._client = client
        self._timeouts = timeouts
        self._verdicts = verdicts
        self._metrics = metrics
        self._background: set[asyncio.Task[Any]] = set()
        self._watchdog = StreamWatchdog(client.read_timeout)
        self._watchdog_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._watchdog_task = asyncio.create_task(self._watchdog.run())

    async def aclose(self) -> None:
        watchdog = [self._watchdog_task] if self._watchdog_task is not None else []
        await cancel(*self._background, *watchdog)

    async def prefill(self, request: ClientRequest, transfer: Transfer) -> dict[str, Any]:
        """Run the clamped prefill leg and return P's answer."""
        endpoint = transfer.decision.prefill
        body = orjson.dumps(self._connector.prefill_body(request.body, transfer))
        headers = leg_headers(
            transfer.request_id, request.authorization, transfer.decision.prefill_dp_rank
        )
        started = time.perf_counter()
        endpoint.in_flight += 1
        try:
            upstream, data = await self._client.post_read(
                endpoint.url + request.kind.path,
                body,
                headers,
                leg="prefill",
                within=self._timeouts.prefill,
            )
            answer = _prefill_answer(upstream, data)
        except ProxyError as error:
            self._verdicts.judge(endpoint, error)
            raise
        except BaseException:
            self._verdicts.abandoned(endpoint)
            raise
        finally:
            endpoint.in_flight -= 1
        self._metrics.prefill_seconds.observe(time.perf_counter() - started)
        self._verdicts.success(endpoint)
        return answer

    async def decode(
        self, request: ClientRequest, transfer: Transfer, prefill_answer: Mapping[str, Any] | None
    ) -> ProxyResponse:
        """Open the decode leg; its status (and a stream's first bytes) are checked before
        the client's response starts."""
        endpoint = transfer.decision.decode
        body = self._connector.decode_body(request.body, transfer, prefill_answer)
        if prefill_answer is not None and "kv_transfer_params" not in prefill_answer:
            self._metrics.kv_params_missing.inc()
        headers = leg_headers(transfer.request_id, request.authorization)
        streaming = is_streaming(request.body)
        endpoint.in_flight += 1
        try:
            upstream = await self._client.post(
                endpoint.url + request.kind.path,
                orjson.dumps(body),
                headers,
                leg="decode",
                stream=streaming,
                headers_within=self._timeouts.decode_headers,
            )
            if streaming and upstream.status < 300:
                return await self._stream(upstream, endpoint, transfer.request_id, prefill_answer)
            response = _whole_answer(upstream, await upstream.read_all(), transfer.request_id)
        except ProxyError as error:
            endpoint.in_flight -= 1
            self._verdicts.judge(endpoint, error)
            raise
        except BaseException:
            endpoint.in_flight -= 1
            self._verdicts.abandoned(endpoint)
            raise
        endpoint.in_flight -= 1
        self._succeeded(endpoint, prefill_answer)
        return response

    def _succeeded(self, decode: Endpoint, prefill_answer: Mapping[str, Any] | None) -> None:
        self._verdicts.success(decode)
        source = self._connector.kv_source(prefill_answer) if prefill_answer else None
        if source is not None:
            decode.read_from(source)

    async def _stream(
        self,
        upstream: UpstreamResponse,
        endpoint: Endpoint,
        request_id: str,
        prefill_answer: Mapping[str, Any] | None,
    ) -> ProxyResponse:
        """Wait for the stream's first bytes; from then on the relay owns the leg (and
        uncounts it when it closes). Raises with the leg uncounted."""
        relay = StreamRelay(upstream, lambda: None, self._watchdog)
        try:
            await relay.prime()
        except BaseException:
            relay.close()
            raise
        relay.when_closed(lambda: self._stream_closed(endpoint, relay))
        self._succeeded(endpoint, prefill_answer)
        return ProxyResponse(200, "text/event-stream", request_id, stream=relay)

    def _stream_closed(self, endpoint: Endpoint, relay: StreamRelay) -> None:
        endpoint.in_flight -= 1
        failure = relay.failure
        if isinstance(failure, UpstreamError) and failure.leg == "decode":
            self._verdicts.judge(endpoint, failure)

    async def concurrent(self, request: ClientRequest, transfer: Transfer) -> ProxyResponse:
        """Send P and D together (push/WRITE transfers); a failed P aborts D."""
        prefill = asyncio.create_task(self.prefill(request, transfer))
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
