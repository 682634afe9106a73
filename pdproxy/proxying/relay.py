"""Relays a decode engine's SSE stream to the client as bytes, never re-parsing chunks.

The only inspection is the stream's tail: a vLLM completions or chat stream always ends
with ``data: [DONE]`` (a Responses API stream with its terminal event: ``Framing``), so a
stream that ends without it was cut, and the client gets one OpenAI-style error event
instead of a silent truncation. The watchdog's clock and the size limits are kept here too.

This is the plain relay. What a request may add wraps it (``ClientStream``): a stream that
continues on another decode when cut (``resumable.ResumableStream``), one translated to
another API's shape (``resumable.TranslatedStream``); the first token's splice is a
``ByteStream`` that a plain relay reads (``first_token``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from pdproxy.errors import EngineErrorEvent, ProxyError, UpstreamError, UpstreamProtocolError
from pdproxy.proxying.framing import OPENAI_SSE, SSE_DONE, Framing
from pdproxy.proxying.watchdog import StreamWatchdog

# Takes a chunk for the client's socket now; False when it cannot (full, or gone).
Write = Callable[[bytes], bool]


class ByteStream(Protocol):
    """What a relay reads: an engine's answer (``UpstreamResponse``), or a stream pdproxy
    starts itself and continues with one (``pdproxy.proxying.first_token``)."""

    async def read_chunk(self) -> bytes: ...

    def push_to(self, sink: Callable[[bytes], bool] | None) -> None: ...

    def release(self) -> None: ...

    def close(self) -> None: ...


class ClientStream(Protocol):
    """A streamed answer as the client's response reads it: a ``StreamRelay``, or a
    wrapper around one. ``close()`` must be called; it is idempotent."""

    @property
    def origin(self) -> str | None: ...

    @property
    def pushed(self) -> int: ...

    @property
    def failure(self) -> ProxyError | None: ...

    async def read(self) -> bytes | None: ...

    def fail(self, error: ProxyError) -> bytes: ...

    async def next_chunk(self) -> bytes | None: ...

    def relay_directly(self, write: Write) -> None: ...

    def abort(self, failure: ProxyError) -> None: ...

    def close(self) -> None: ...


class ReadThenFail:
    """A ``ClientStream``'s ``next_chunk``: its next bytes (``read``), or once a cut raises,
    the failure's error event (``fail``)."""

    __slots__ = ()

    async def read(self) -> bytes | None:
        raise NotImplementedError

    def fail(self, error: ProxyError) -> bytes:
        raise NotImplementedError

    async def next_chunk(self) -> bytes | None:
        """The next bytes for the client, or None once the stream is over.

        A broken or cut upstream yields one last chunk: the terminal error event.
        """
        try:
            return await self.read()
        except ProxyError as error:
            return self.fail(error)


class StreamRelay(ReadThenFail):
    """An upstream stream being relayed. ``close()`` must be called; it is idempotent.

    Closing drops the upstream connection (vLLM aborts the request) and runs ``on_close``
    exactly once, which frees the proxy's counters.
    """

    def __init__(
        self,
        upstream: ByteStream,
        on_close: Callable[[], None],
        watchdog: StreamWatchdog,
        framing: Framing = OPENAI_SSE,
    ) -> None:
        self._upstream = upstream
        self._ends, self._error_event = framing.ends, framing.error_event
        self._tail_size = framing.tail
        self._on_close: Callable[[], None] | None = on_close
        self._failure: ProxyError | None = None
        self._done = False
        self._tail = b""  # the stream's last bytes, where its end marker lies
        self._first: bytes | None = None  # read by prime(), not yet handed out
        self._watchdog = watchdog
        self._write: Write | None = None  # relay_directly's
        self._pushed = 0  # bytes handed to it
        self.origin: str | None = None  # the decode's URL, set by the leg that opened it
        self.oversized = False  # past a size limit: cut inside an event, never continued
        self._relayed = 0  # the engine's bytes so far
        self._open_event = 0  # bytes since the last event's end
        self._max_stream, self._max_event = watchdog.max_stream, watchdog.max_event
        self._clock = watchdog.clock
        self.last_activity = self._clock()
        watchdog.watch(self)

    def when_closed(self, on_close: Callable[[], None]) -> None:
        """Replace the callback ``close()`` runs (once the stream is handed on)."""
        self._on_close = on_close

    @property
    def pushed(self) -> int:
        """The bytes handed to ``relay_directly``'s writer."""
        return self._pushed

    def relay_directly(self, write: Write) -> None:
        """From now on hand each chunk the engine sends to ``write`` in the engine
        connection's own callback: no future, task step or ASGI message per token.

        ``write`` returns False when it cannot take a chunk now (the client's socket is
        full, or the client is gone); that chunk and the ones after it then come from
        ``next_chunk`` again, until this is called anew. The stream's last chunk (the one
        that ends with ``[DONE]``) and its end always come from ``next_chunk``, so the
        caller ends the response.
        """
        if not self._done and self._first is None:
            self._write = write
            self._upstream.push_to(self._push)

    def _push(self, chunk: bytes) -> bool:
        write = self._write
        if write is None or chunk.endswith(SSE_DONE) or not write(chunk):
            self._write = None
            self._upstream.push_to(None)
            return False
        self._seen(chunk)
        self._pushed += len(chunk)
        return True

    def _seen(self, chunk: bytes) -> None:
        """A chunk came from the engine: the watchdog's clock, and the tail the end check
        reads (a token's chunk is longer than the marker: a reference, no copy). Past the
        stream's or one event's size limit, the stream is ended."""
        self.last_activity = self._clock()
        self._relayed += len(chunk)
        if self._relayed > self._max_stream:
            self._oversized(f"a stream over {self._max_stream} bytes")
        if chunk.endswith(b"\n\n"):  # vLLM's usual chunk: whole events
            self._open_event = 0
        elif (end := chunk.rfind(b"\n\n")) >= 0:  # one scan, at memchr's speed
            self._open_event = len(chunk) - end - 2
        else:
            self._open_event += len(chunk)
            if self._open_event > self._max_event:
                self._oversized(f"an SSE event over {self._max_event} bytes")
        size = self._tail_size
        self._tail = chunk if len(chunk) >= size else (self._tail + chunk)[-size:]

    def _oversized(self, what: str) -> None:
        """The engine sent more than a limit allows: the stream cannot be continued (its
        event is unfinished) and ends with the error event; the leg fails as malformed."""
        self.oversized = True
        self._write = None
        self._upstream.push_to(None)
        self.abort(UpstreamProtocolError(f"decode engine sent {what}", leg="decode"))

    def abort(self, failure: ProxyError) -> None:
        """Stop relaying because of ``failure`` (e.g. the concurrent prefill failed)."""
        self._failure = failure
        self._upstream.close()

    async def prime(self) -> None:
        """Wait for the stream's first bytes before the client's response starts.

        Raises ``UpstreamError`` if the stream breaks, falls silent past the watchdog or
        ends before any byte: nothing has reached the client, so the leg can be retried.
        """
        try:
            chunk = await self._upstream.read_chunk()
        except UpstreamError as exc:
            if self._failure is not None:  # the watchdog (or a failed prefill) aborted it
                raise self._failure from exc
            raise
        if not chunk:
            raise self._failure or UpstreamProtocolError(
                "decode engine ended the stream before its first chunk", leg="decode"
            )
        self.last_activity = self._clock()
        self._tail = chunk[-self._tail_size :]
        self._first = chunk

    async def read(self) -> bytes | None:
        """The engine's next bytes, or None at the stream's complete end; a cut (broken,
        ended early, aborted) raises its ``ProxyError`` (``fail`` turns it into the
        client's error event)."""
        if self._first is not None:
            chunk, self._first = self._first, None
            return chunk
        if self._done:
            return None
        aborted = None
        try:
            chunk = await self._upstream.read_chunk()
        except UpstreamError:
            if self._failure is None:
                raise
            aborted = self._failure  # the watchdog's, a drain's, a failed prefill's
        if aborted is not None:  # raised here, not chained: no cycle through this frame
            raise aborted
        if chunk:
            self._seen(chunk)
            return chunk
        if not self._tail.rstrip().endswith(self._ends):
            raise self._failure or UpstreamProtocolError(
                "decode engine ended the stream early", leg="decode"
            )
        self._done = True
        self._upstream.release()  # complete: keep the connection for the next request
        return None

    def fail(self, error: ProxyError) -> bytes:
        """The stream ends with ``error`` (or the failure it had): its error event."""
        self._done = True
        failure = self._failure = _untraced(self._failure or error)
        separator = b"" if not self._tail or self._tail.endswith(b"\n\n") else b"\n\n"
        if isinstance(failure, EngineErrorEvent):  # the engine's own, as it sent it
            return separator + failure.sse()
        return separator + self._error_event(failure)

    def cut(self, error: ProxyError) -> ProxyError:
        """End this leg now, judged by ``error`` (or the failure it had), which it returns:
        the stream continues elsewhere (``ResumableStream``)."""
        failure = self._failure = _untraced(self._failure or error)
        self.close()
        return failure

    @property
    def failure(self) -> ProxyError | None:
        """Why the stream ended with an error event, if it did."""
        return self._failure

    def close(self) -> None:
        self._done = True
        self._write = None
        self._watchdog.forget(self)
        self._upstream.close()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()


def _untraced(failure: ProxyError) -> ProxyError:
    """``failure`` kept without its tracebacks (its own and its causes'): raised through
    the relay and its wrappers, they held their frames, the relay itself and the bytes a
    resumable stream kept, in a cycle only the garbage collector frees."""
    seen: BaseException | None = failure
    for _ in range(8):  # a cause's cause, at most
        if seen is None:
            break
        seen.__traceback__ = None
        seen = seen.__cause__ or seen.__context__
    return failure
