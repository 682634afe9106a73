"""Relays a decode engine's SSE stream to the client as bytes, never re-parsing chunks.

The only inspection is the stream's tail: a vLLM completions or chat stream always ends
with ``data: [DONE]`` (a Responses API stream with its terminal event: ``Framing``), so a
stream that ends without it was cut (so is a migratable one with the engine's own error
event), and the client gets one OpenAI-style error event instead of a silent truncation,
unless a ``Resume`` hook continues it on another decode (``migrate_with``): the relay then
reads the continuation's stream in place of the cut one, rewritten to read as one stream.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from pdproxy import errors
from pdproxy.errors import ProxyError, UpstreamError, UpstreamProtocolError
from pdproxy.proxying.framing import OPENAI_SSE, SSE_DONE, Framing
from pdproxy.proxying.kept_stream import Fold, KeptStream
from pdproxy.proxying.watchdog import StreamWatchdog
from pdproxy.wire.continuation import engine_error_at


class ByteStream(Protocol):
    """What a relay reads: an engine's answer (``UpstreamResponse``), or a stream pdproxy
    starts itself and continues with one (``pdproxy.proxying.first_token``)."""

    async def read_chunk(self) -> bytes: ...

    def push_to(self, sink: Callable[[bytes], bool] | None) -> None: ...

    def release(self) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Continuation:
    """A cut stream's continuation: the relay of its stream (primed), and what makes its
    bytes read as the cut stream's."""

    relay: StreamRelay
    rewrite: Callable[[bytes], bytes]


# Called with what the cut stream delivered (the engine's bytes) and why it was cut; returns
# its continuation, or None when the stream must end with the error event.
Resume = Callable[[bytes, ProxyError], Awaitable[Continuation | None]]


class StreamRelay:
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
        self._translate: Callable[[bytes], bytes] | None = None
        self._write: Callable[[bytes], bool] | None = None  # relay_directly's
        self.pushed = 0  # bytes handed to it
        self.origin: str | None = None  # the decode's URL, set by the leg that opened it
        self._resumable: KeptStream[Resume] | None = None  # set while it may migrate
        self._relayed = 0  # the engine's bytes so far
        self._open_event = 0  # bytes since the last event's end
        self._max_stream, self._max_event = watchdog.max_stream, watchdog.max_event
        self._pending: errors.EngineErrorEvent | None = None  # read after events still to hand out
        self._inner: StreamRelay | None = None  # the continuation read in place of this
        self._rewrite: Callable[[bytes], bytes] | None = None
        self._clock = watchdog.clock
        self.last_activity = self._clock()
        watchdog.watch(self)

    def when_closed(self, on_close: Callable[[], None]) -> None:
        """Replace the callback ``close()`` runs (once the stream is handed on)."""
        self._on_close = on_close

    def translate(self, translate: Callable[[bytes], bytes]) -> None:
        """Hand the client ``translate(bytes)`` of the engine's bytes from now on (render-once
        answers generate's stream in the OpenAI shape); the end check still reads the
        engine's own bytes, and the relay's error events pass untranslated."""
        self._translate = translate

    def migrate_with(self, resume: Resume, fold: Fold) -> None:
        """Continue this stream with ``resume`` if it is cut; from now on its bytes are
        kept (a reference per chunk) for ``resume`` to read what was generated, those of
        a long stream handed to ``fold`` every ``FOLD_BYTES`` so that memory stays bounded."""
        resumable = self._resumable
        if resumable is None:
            self._resumable = KeptStream(resume, fold, self._first)
        else:
            resumable.resume, resumable.fold = resume, fold

    def relay_directly(self, write: Callable[[bytes], bool]) -> None:
        """From now on hand each chunk the engine sends to ``write`` in the engine
        connection's own callback: no future, task step or ASGI message per token.

        ``write`` returns False when it cannot take a chunk now (the client's socket is
        full, or the client is gone); that chunk and the ones after it then come from
        ``next_chunk`` again, until this is called anew. The stream's last chunk (the one
        that ends with ``[DONE]``) and its end always come from ``next_chunk``, so the
        caller ends the response; a translated stream is never relayed this way.
        """
        if (
            self._translate is None
            and not self._done
            and self._first is None
            and self._inner is None
        ):
            self._write = write
            self._upstream.push_to(self._push)

    def _push(self, chunk: bytes) -> bool:
        write = self._write
        stop = self._resumable is not None and engine_error_at(chunk) >= 0  # next_chunk's to cut
        if stop or write is None or chunk.endswith(SSE_DONE) or not write(chunk):
            self._write = None
            self._upstream.push_to(None)
            return False
        self._seen(chunk)
        self.pushed += len(chunk)
        return True

    def _seen(self, chunk: bytes) -> None:
        """A chunk came from the engine: the watchdog's clock, and the tail the end check
        reads (a token's chunk is longer than the marker: a reference, no copy). Past the
        stream's or (kept) one event's size limit, the stream is ended."""
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
        resumable = self._resumable
        if resumable is not None and not resumable.keep(chunk, self._tail):
            self._resumable = None  # a fold refused it: it can no longer migrate
        size = self._tail_size
        self._tail = chunk if len(chunk) >= size else (self._tail + chunk)[-size:]

    def _oversized(self, what: str) -> None:
        """The engine sent more than a limit allows: the stream cannot migrate (its event
        is unfinished) and ends with the error event; the leg fails as malformed."""
        self._resumable = None
        self._write = None
        self._upstream.push_to(None)
        self.abort(UpstreamProtocolError(f"decode engine sent {what}", leg="decode"))

    def abort(self, failure: ProxyError) -> None:
        """Stop relaying because of ``failure`` (e.g. the concurrent prefill failed)."""
        if self._inner is not None:
            self._inner.abort(failure)
            return
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

    async def next_chunk(self) -> bytes | None:
        """The next bytes for the client, or None once the stream is over.

        A broken or cut upstream yields one last chunk: the terminal error event.
        """
        translate = self._translate
        if translate is None:
            return await self._next()
        while True:
            chunk = await self._next()
            if chunk is None or (self._done and self._failure is not None):
                return chunk  # the end, or the relay's own error event
            chunk = translate(chunk)
            if chunk:
                return chunk

    async def _next(self) -> bytes | None:
        if self._inner is not None:
            return await self._next_continued(self._inner)
        if self._first is not None:
            chunk, self._first = self._first, None
            resumable = self._resumable
            if resumable is None or (at := engine_error_at(chunk)) < 0:
                return chunk
            resumable.kept = []  # it is kept again as far as it is handed out
            return await self._engine_error(chunk, at)
        if self._done:
            return None
        if self._pending is not None:
            return await self._cut(self._pending)
        try:
            chunk = await self._upstream.read_chunk()
        except UpstreamError as exc:
            return await self._cut(exc)
        if chunk:
            if self._resumable is not None and (at := engine_error_at(chunk)) >= 0:
                return await self._engine_error(chunk, at)
            self._seen(chunk)
            return chunk
        if not self._tail.rstrip().endswith(self._ends):
            return await self._cut(
                UpstreamProtocolError("decode engine ended the stream early", leg="decode")
            )
        self._done = True
        self._upstream.release()  # complete: keep the connection for the next request
        return None

    async def _engine_error(self, chunk: bytes, at: int) -> bytes | None:
        """The engine's error event at ``at`` cuts the stream; the events before it go first."""
        if at == 0:
            return await self._cut(errors.EngineErrorEvent(chunk))
        self._pending = errors.EngineErrorEvent(chunk[at:])
        self._seen(chunk[:at])
        return chunk[:at]

    async def _cut(self, error: UpstreamError) -> bytes | None:
        """The stream was cut: continue it elsewhere if it may be, else its error event."""
        resumable, self._resumable, self._pending = self._resumable, None, None
        if resumable is None:
            return self._fail(error)
        # The cut leg ends now (uncounted, judged by its failure), before the continuation's
        # legs are sent; the continuation's relay owns its own leg and is read from here on.
        self._failure = failure = self._failure or error
        self._watchdog.forget(self)
        self._upstream.close()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()
        continuation = await resumable.resume(resumable.delivered(), failure)
        if continuation is None:
            return self._fail(error)
        self._failure = None
        self._inner, self._rewrite = continuation.relay, continuation.rewrite
        return await self._next_continued(continuation.relay)

    async def _next_continued(self, inner: StreamRelay) -> bytes | None:
        rewrite = self._rewrite
        while True:
            chunk = await inner._next()
            if chunk is None or rewrite is None or inner.failure is not None:
                return chunk  # the end, or its own error event: as it is
            chunk = rewrite(chunk)
            if chunk:
                return chunk

    @property
    def failure(self) -> ProxyError | None:
        """Why the stream ended with an error event, if it did."""
        if self._inner is not None:
            return self._inner.failure
        return self._failure

    def _fail(self, error: UpstreamError) -> bytes:
        self._done = True
        failure = self._failure = self._failure or error
        separator = b"" if not self._tail or self._tail.endswith(b"\n\n") else b"\n\n"
        if isinstance(failure, errors.EngineErrorEvent):  # the engine's own, as without migration
            return separator + failure.sse()
        return separator + self._error_event(failure)

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
        self._done = True
        self._write = None
        self._watchdog.forget(self)
        self._upstream.close()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()
