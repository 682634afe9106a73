"""The first token from the prefill (``--first-token-from-prefill``): the client's stream starts
with the token the prefill sampled, while the decode leg is still being opened.

After the prefill answered, ``FirstTokenPath.answer`` decides (``pdproxy.wire.first_token``):

* the usual path (None): the request does not qualify, or the prompt sits on the block-size
  edge, or the prefill's answer is not one token in vLLM's shape;
* ``t1`` ended the request (EOS, a stop string or token, or ``max_tokens`` 1): the whole
  stream is written from the prefill's answer, no decode leg is sent, and the prefill's KV
  is released (``KVRelease``);
* otherwise the stream's first chunk is ``t1``, and the decode leg (prompt ids + ``[t1]``)
  is sent at once; its chunks follow, their usage counted as the client's request. Its
  failure, even before its first byte, reaches the client as the stream's error event: the
  client has ``t1`` already, so the leg is not retried.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from pdproxy.connectors import Transfer
from pdproxy.errors import ProxyError, UpstreamError, UpstreamProtocolError
from pdproxy.observability.request_context import current
from pdproxy.proxying.exchange import ClientRequest, ProxyResponse
from pdproxy.proxying.kv_release import KVRelease
from pdproxy.proxying.legs import Legs
from pdproxy.proxying.relay import ClientStream, StreamRelay
from pdproxy.wire.first_token import (
    BlockSizes,
    FirstToken,
    continued_body,
    ended_stream,
    first_chunk,
    first_token,
    fix_usage,
    has_stop_strings,
    held_blocks,
    reason,
)
from pdproxy.wire.shaping import TOKEN_IDS, includes_usage

logger = logging.getLogger(__name__)

_SSE = "text/event-stream"


class FirstTokenPath:
    def __init__(self, *, legs: Legs, release: KVRelease) -> None:
        self._legs = legs
        self._release = release
        self._blocks = BlockSizes()

    def answer(
        self, request: ClientRequest, transfer: Transfer, prefill: Mapping[str, Any]
    ) -> ProxyResponse | None:
        """The client's stream started with the prefill's token, or None for the usual
        decode leg."""
        token = self._first_token(request, transfer, prefill)
        if token is None:
            return None
        trace = current()
        trace.decode_url = transfer.decision.decode.url  # render-once's fingerprint reads it
        if token.finish_reason is not None:
            self._release.orphaned(request, transfer, prefill, failed=None)
            whole = ended_stream(token, includes_usage(request.body))
            return self._response(transfer, _Spliced(whole, None))
        continued = dataclasses.replace(request, body=continued_body(request.body, token.token))
        opening = asyncio.ensure_future(self._legs.decode(continued, transfer, prefill))
        return self._response(transfer, _Spliced(first_chunk(token), opening))

    def _response(self, transfer: Transfer, spliced: _Spliced) -> ProxyResponse:
        relay = StreamRelay(spliced, lambda: None, self._legs.watchdog)
        # the decode the stream continues on: a migration never picks it again for the stream
        relay.origin = transfer.decision.decode.url
        return ProxyResponse(200, _SSE, transfer.request_id, stream=relay)

    def _first_token(
        self, request: ClientRequest, transfer: Transfer, prefill: Mapping[str, Any]
    ) -> FirstToken | None:
        body = request.body
        if reason(body) is not None:
            return None
        held = held_blocks(prefill)
        if held is None:
            return None
        _engine, tokens, blocks = held
        # What is learned is the instance's pdproxy sent the leg to, never the engine id
        # the prefill reports (a prefill claiming another's id poisoned its bounds).
        decision = transfer.decision
        source = f"{decision.prefill.url}|{decision.prefill_dp_rank or 0}"
        if self._blocks.too_few(source, tokens, blocks):
            logger.warning(
                "%s: prefill %s lists %d blocks for %d prompt tokens: the usual decode",
                transfer.request_id,
                decision.prefill.url,
                blocks,
                tokens,
            )
            self._legs.count_failure(decision.prefill, "too_few_blocks")
            return None
        self._blocks.observe(source, tokens, blocks)
        token = first_token(body, prefill)
        if token is None:
            return None
        if token.finish_reason is not None:
            return token  # no decode: no block to allocate
        if has_stop_strings(body) or tokens != len(body[TOKEN_IDS]):
            return None
        if self._blocks.on_edge(source, tokens, blocks):
            logger.debug("%s: on the block-size edge, the usual decode", token.request_id)
            return None
        return token


class _Spliced:
    """The bytes a ``StreamRelay`` reads for a stream that starts with ``t1``: the chunk,
    then the decode leg's stream once it is open (``opening``; its failure raised as the
    leg's), or nothing more (None: ``head`` is the whole stream)."""

    def __init__(self, head: bytes, opening: asyncio.Future[ProxyResponse] | None) -> None:
        self._head: bytes | None = head
        self._opening = opening
        self._relay: ClientStream | None = None
        if opening is not None:
            opening.add_done_callback(_consume)

    async def read_chunk(self) -> bytes:
        if self._head is not None:
            head, self._head = self._head, None
            return head
        if self._opening is None:
            return b""
        try:
            relay = self._relay
            if relay is None:
                relay = self._relay = await self._opened(self._opening)
            chunk = await relay.next_chunk()
            failure = relay.failure
        except ProxyError as error:
            raise _as_upstream(error) from error
        if failure is not None:
            raise _as_upstream(failure)
        return b"" if chunk is None else fix_usage(chunk)

    @staticmethod
    async def _opened(opening: asyncio.Future[ProxyResponse]) -> ClientStream:
        try:
            response = await opening
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not opening.cancelled() or (task is not None and task.cancelling()):
                raise  # the reader itself is cancelled (the client left)
            # close() gave the leg up (the watchdog, a drain): a failure, not a cancellation
            raise UpstreamProtocolError("decode leg abandoned", leg="decode") from None
        if response.stream is None:  # a stream was asked: the leg checks it came as one
            raise UpstreamProtocolError("decode engine answered a stream whole", leg="decode")
        return response.stream

    def push_to(self, sink: Callable[[bytes], bool] | None) -> None:
        """Chunks are read, never pushed (the relay's direct writes stay off)."""

    def release(self) -> None:
        """The decode's own relay pools its connection."""

    def close(self) -> None:
        opening = self._opening
        if self._relay is not None:
            self._relay.close()
        elif opening is None:
            return
        elif not opening.done():
            opening.cancel()  # the leg is abandoned: vLLM aborts it
        elif not opening.cancelled() and opening.exception() is None:
            stream = opening.result().stream  # opened, never read
            if stream is not None:
                stream.close()


def _as_upstream(failure: ProxyError) -> UpstreamError:
    if isinstance(failure, UpstreamError):
        return failure
    return UpstreamProtocolError(str(failure), leg="decode")


def _consume(future: asyncio.Future[ProxyResponse]) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.debug("decode after the first token failed: %r", future.exception())
