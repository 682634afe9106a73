"""Wrappers that compose around a plain ``StreamRelay`` (both are ``ClientStream``s), each
with its own state:

- ``ResumableStream``: a stream that continues on another decode when it is cut (a reset,
  the watchdog, a drain that migrates, the engine's own error event). It keeps what was
  delivered (``KeptStream``) for its ``Resume`` hook, and reads the continuation's stream in
  place of the cut one, rewritten to read as one stream (``pdproxy.proxying.migration``
  arms it).
- ``TranslatedStream``: the engine's bytes handed to the client in another API's shape
  (render-once answers generate's stream as an OpenAI one); its error events pass as they
  are, and it is never relayed directly.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pdproxy.errors import EngineErrorEvent, ProxyError
from pdproxy.proxying.kept_stream import Fold, KeptStream
from pdproxy.proxying.relay import ClientStream, ReadThenFail, StreamRelay, Write
from pdproxy.wire.continuation import engine_error_at


@dataclass(frozen=True, slots=True)
class Continuation:
    """A cut stream's continuation: its stream (primed), and what makes its bytes read as
    the cut stream's."""

    stream: ClientStream
    rewrite: Callable[[bytes], bytes]


# Called with what the cut stream delivered (the engine's bytes) and why it was cut; returns
# its continuation, or None when the stream must end with the error event.
Resume = Callable[[bytes, ProxyError], Awaitable[Continuation | None]]


class ResumableStream(ReadThenFail):
    """``relay``'s stream, continued with ``resume`` if it is cut. Its bytes are kept (a
    reference per chunk) for ``resume`` to read what was generated, those of a long stream
    handed to ``fold`` every ``FOLD_BYTES`` so that memory stays bounded."""

    def __init__(self, relay: StreamRelay, resume: Resume, fold: Fold) -> None:
        self._relay = relay
        self._resume = resume
        self._kept: KeptStream | None = KeptStream(fold)  # None: it can no longer migrate
        self._pending: EngineErrorEvent | None = None  # read after events still to hand out
        self._continued: Continuation | None = None  # read in place of the cut relay
        self._write: Write | None = None  # relay_directly's

    @property
    def origin(self) -> str | None:
        return self._relay.origin

    @property
    def pushed(self) -> int:
        return self._relay.pushed

    @property
    def failure(self) -> ProxyError | None:
        if self._continued is not None:
            return self._continued.stream.failure
        return self._relay.failure

    def relay_directly(self, write: Write) -> None:
        """The relay's direct writes, each chunk kept; one that holds the engine's error
        event is left to ``next_chunk``, which cuts. A continued stream is read only."""
        if self._continued is None and self._pending is None:
            self._write = write
            self._relay.relay_directly(write if self._kept is None else self._keep_and_write)

    def _keep_and_write(self, chunk: bytes) -> bool:
        kept, write = self._kept, self._write
        if write is None or kept is None or engine_error_at(chunk) >= 0 or not write(chunk):
            return False
        if not kept.keep(chunk):
            self._kept = None  # a fold refused it: it can no longer migrate
        return True

    async def read(self) -> bytes | None:
        if self._continued is not None:
            return await self._read_continued(self._continued)
        if self._pending is not None:
            return await self._cut(self._pending)
        try:
            chunk = await self._relay.read()
        except ProxyError as error:
            return await self._cut(error)
        kept = self._kept
        if chunk is None or kept is None:
            return chunk
        if (at := engine_error_at(chunk)) >= 0:
            if at == 0:
                return await self._cut(EngineErrorEvent(chunk))
            self._pending = EngineErrorEvent(chunk[at:])  # the events before it go first
            chunk = chunk[:at]
        if not kept.keep(chunk):
            self._kept = None
        return chunk

    async def _cut(self, error: ProxyError) -> bytes | None:
        """The stream was cut: continue it elsewhere if it may be, else raise its failure."""
        kept, self._kept, self._pending, self._write = self._kept, None, None, None
        relay = self._relay
        if kept is None or relay.oversized:
            raise error
        # The cut leg ends now (uncounted, judged by its failure), before the continuation's
        # legs are sent; the continuation's stream owns its own leg and is read from here on.
        failure = relay.cut(error)
        continuation = await self._resume(kept.delivered(), failure)
        if continuation is None:
            raise failure
        self._continued = continuation
        return await self._read_continued(continuation)

    @staticmethod
    async def _read_continued(continued: Continuation) -> bytes | None:
        stream, rewrite = continued.stream, continued.rewrite
        while True:
            chunk = await stream.read()  # its cut raises: its own error event, as it is
            if chunk is None:
                return None
            chunk = rewrite(chunk)
            if chunk:
                return chunk

    def fail(self, error: ProxyError) -> bytes:
        if self._continued is not None:
            return self._continued.stream.fail(error)
        return self._relay.fail(error)

    def abort(self, failure: ProxyError) -> None:
        if self._continued is not None:
            self._continued.stream.abort(failure)
        else:
            self._relay.abort(failure)

    def close(self) -> None:
        self._write = None
        if self._continued is not None:
            self._continued.stream.close()
        self._relay.close()


class TranslatedStream(ReadThenFail):
    """``stream``'s bytes as ``translate(bytes)`` hands them to the client; the end check
    still reads the engine's own bytes, and the error events pass untranslated."""

    def __init__(self, stream: ClientStream, translate: Callable[[bytes], bytes]) -> None:
        self._stream = stream
        self._translate = translate

    @property
    def origin(self) -> str | None:
        return self._stream.origin

    @property
    def pushed(self) -> int:
        return self._stream.pushed  # nothing: it is never relayed directly

    @property
    def failure(self) -> ProxyError | None:
        return self._stream.failure

    def relay_directly(self, write: Write) -> None:
        """Never: each chunk is translated on the response's task."""

    async def read(self) -> bytes | None:
        translate = self._translate
        while True:
            chunk = await self._stream.read()
            if chunk is None:
                return None
            chunk = translate(chunk)
            if chunk:
                return chunk

    def fail(self, error: ProxyError) -> bytes:
        return self._stream.fail(error)

    def abort(self, failure: ProxyError) -> None:
        self._stream.abort(failure)

    def close(self) -> None:
        self._stream.close()
