"""Relays a decode engine's SSE stream to the client as bytes, never re-parsing chunks.

The only inspection is the stream's tail: a vLLM stream always ends with ``data: [DONE]``,
so a stream that ends without it was cut, and the client gets one OpenAI-style error event
instead of a silent truncation.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import orjson

from pdproxy.engine_client import UpstreamResponse
from pdproxy.errors import ProxyError, UpstreamError, UpstreamProtocolError

_DONE = b"data: [DONE]"
SSE_DONE = _DONE + b"\n\n"
_TAIL = 32


def sse_error_event(error: ProxyError) -> bytes:
    """One terminal SSE error event, followed by ``[DONE]`` as vLLM does after an error."""
    return b"data: " + orjson.dumps(error.to_dict()) + b"\n\ndata: [DONE]\n\n"


class StreamRelay:
    """An upstream stream being relayed. ``close()`` must be called; it is idempotent.

    Closing drops the upstream connection (vLLM aborts the request) and runs ``on_close``
    exactly once, which frees the proxy's counters.
    """

    def __init__(self, upstream: UpstreamResponse, on_close: Callable[[], None]) -> None:
        self._upstream = upstream
        self._on_close: Callable[[], None] | None = on_close
        self._failure: ProxyError | None = None

    def abort(self, failure: ProxyError) -> None:
        """Stop relaying because of ``failure`` (e.g. the concurrent prefill failed)."""
        self._failure = failure
        self._upstream.close()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        tail = b""
        try:
            async for chunk in self._upstream.chunks():
                tail = chunk[-_TAIL:] if len(chunk) >= _TAIL else (tail + chunk)[-_TAIL:]
                yield chunk
            if not tail.rstrip().endswith(_DONE):
                raise UpstreamProtocolError("decode engine ended the stream early", leg="decode")
            self._upstream.release()  # complete: keep the connection for the next request
        except UpstreamError as exc:
            failure = self._failure or exc
            separator = b"" if not tail or tail.endswith(b"\n\n") else b"\n\n"
            yield separator + sse_error_event(failure)
        finally:
            self.close()

    def close(self) -> None:
        self._upstream.close()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()
