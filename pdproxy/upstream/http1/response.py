"""The answer a connection is reading (``Response``) and its header fields (``Headers``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any, Protocol, overload

from pdproxy.upstream.http1.coding import Decoder, decoder_for
from pdproxy.upstream.http1.errors import (
    HTTPError,
    MalformedResponse,
    ReadTimeout,
    ResponseTooLarge,
)

HIGH_WATER = 256 * 1024  # body bytes buffered before the engine's socket is paused
# Fields that may not be joined into one value (RFC 9110 5.3): ``get`` gives the first.
_FIRST_ONLY = frozenset({"set-cookie", "content-type", "content-length"})


class Headers:
    """An answer's header fields in the order they came, names in lower case, repeats
    kept. ``get`` joins a repeated field's values with ", " (RFC 9110 5.3), except for
    fields that cannot be joined (Set-Cookie, and singletons such as Content-Type: the
    first); ``get_all`` gives every value."""

    __slots__ = ("_fields", "_index")

    def __init__(self, fields: list[tuple[str, str]]) -> None:
        self._fields = fields
        index: dict[str, str] = {}
        for name, value in fields:
            if name not in index:
                index[name] = value
            elif name not in _FIRST_ONLY:
                index[name] += ", " + value
        self._index = index

    @overload
    def get(self, name: str) -> str | None: ...

    @overload
    def get(self, name: str, default: str) -> str: ...

    def get(self, name: str, default: str | None = None) -> str | None:
        """The field's value (``name`` in lower case), or ``default``."""
        return self._index.get(name, default)

    def get_all(self, name: str) -> list[str]:
        return [value for field, value in self._fields if field == name]

    def items(self) -> list[tuple[str, str]]:
        """Every field, repeats included, in order."""
        return list(self._fields)

    def __getitem__(self, name: str) -> str:
        return self._index[name]

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


class _Pool(Protocol):
    def release(self, connection: Any) -> None: ...

    def discard(self, connection: Any) -> None: ...


class Source(Protocol):
    """The connection an answer is read from (``connection.Connection``), as the answer uses
    it: a protocol, as the connection's ``Owner`` is, so that only the connection imports the
    other's module."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop: ...

    @property
    def pool(self) -> _Pool: ...

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


class Response:
    """An answer whose status and headers have arrived; its body is read with
    ``read_chunk``/``read_all``, then the connection is ``release()``d or ``close()``d.

    A gzip or deflate body is decoded as it is read (``coding``; its ``Content-Encoding``
    stays in ``headers``). ``read_all`` refuses a body over ``limit`` bytes."""

    def __init__(
        self, connection: Source, deadline: float | None, *, post: bool, limit: int
    ) -> None:
        self.status = 0
        self.headers = Headers([])
        self.complete = False
        self._connection = connection
        self._loop = connection.loop
        self._deadline = deadline  # loop time the whole answer must be in by
        self._post = post  # a POST's answer must have a body: never 204 or 304
        self._limit = limit
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._error: HTTPError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._keep_alive = False
        self._framed = False  # a length or chunked: else the body ends with the connection
        self._done = False  # released or closed
        self._sink: Callable[[bytes], bool] | None = None  # push_to's
        self._decoder: Decoder | None = None

    async def _wait(self, timeout: float | None) -> None:
        if timeout is None and self._deadline is None:  # a stream's body: no timer
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None
            return
        deadline = self._deadline
        if deadline is not None:
            left = deadline - self._loop.time()
            timeout = left if timeout is None else min(timeout, left)
            if timeout <= 0:
                raise ReadTimeout("the answer missed its deadline")
        waiter = self._waiter = self._loop.create_future()
        timer = None if timeout is None else self._loop.call_later(timeout, _expire, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def _wait_headers(self, by: float | None) -> None:
        """Until the final status and headers are in (interim 1xx answers are skipped by
        the connection), at the latest at loop time ``by``."""
        while not self.status:
            if self._error is not None:
                raise self._error
            timeout = None if by is None else by - self._loop.time()
            if timeout is not None and timeout <= 0:
                raise ReadTimeout("the engine's answer did not start in time")
            await self._wait(timeout)

    async def read_chunk(self, timeout: float | None = None) -> bytes:
        """Whatever body bytes have arrived (waiting at most ``timeout`` for some); b"" once
        the body is whole. A coded body: at most ``coding.PIECE`` decoded bytes."""
        if self._decoder is not None:
            return await self._read_decoded(self._decoder, timeout)
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                if self._buffered > HIGH_WATER:
                    self._connection.resume_reading()
                self._buffered = 0
                return data
            if self._error is not None:
                raise self._error
            if self.complete:
                return b""
            await self._wait(timeout)

    async def _read_decoded(self, decoder: Decoder, timeout: float | None) -> bytes:
        """``read_chunk`` for a coded body: the raw bytes as it takes them, decoded."""
        try:
            while True:
                if decoder.pending:
                    await asyncio.sleep(0)  # a piece per loop turn: a bomb never holds the loop
                    piece = decoder.decode(b"")
                elif self._chunks:
                    piece = decoder.decode(self._take())
                elif self._error is not None:
                    raise self._error
                elif self.complete:
                    decoder.finish()
                    return b""
                else:
                    await self._wait(timeout)
                    continue
                if piece:
                    return piece
        except MalformedResponse as exc:
            self._fail(exc)
            raise

    def _take(self) -> bytes:
        """The buffered body bytes (``read_chunk`` does the same inline, per token)."""
        chunks = self._chunks
        data = b"".join(chunks)
        chunks.clear()
        if self._buffered > HIGH_WATER:
            self._connection.resume_reading()
        self._buffered = 0
        return data

    def push_to(self, sink: Callable[[bytes], bool] | None) -> None:
        """While set, body bytes are handed to ``sink`` in the connection's own callback as
        they arrive (the pieces of one read joined), before any reader waits for them;
        ``sink`` returns False to decline them, and they are then buffered (with all that
        follows) for ``read_chunk`` as usual. Bytes already buffered come first: none are
        offered while some wait. A coded body is never pushed (it must be decoded)."""
        self._sink = sink if self._decoder is None else None

    async def read_all(self, timeout: float | None = None) -> bytes:
        """The whole body, each silence at most ``timeout``; ``ResponseTooLarge`` past the
        pool's body cap (counted as the bytes come, decoded for a coded body: at most the
        cap and one read are ever held)."""
        limit = self._limit
        length = self.headers.get("content-length")
        if self._decoder is None and length is not None and int(length) > limit:
            raise ResponseTooLarge(limit)
        parts: list[bytes] = []
        size = 0
        while chunk := await self.read_chunk(timeout):
            size += len(chunk)
            if size > limit:
                # the traceback keeps this frame until a collection: not the body with it
                parts.clear()
                raise ResponseTooLarge(limit)
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Done with a whole body: the connection is pooled again if it stands at a clean
        message boundary (the answer complete and read whole, keep-alive, no error and
        nothing after it: the pool checks the connection is still open and quiet)."""
        if self._done:
            return
        if self.complete and self._keep_alive and self._error is None and not self._chunks:
            self._done = True
            self._sink = None
            self._connection.pool.release(self._connection)
        else:
            self.close()

    def close(self) -> None:
        """Abandon the answer: the connection is closed (vLLM aborts the request)."""
        if not self._done:
            self._done = True
            self._sink = None
            self._connection.pool.discard(self._connection)

    # --- fed by the connection ---

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _feed(self, data: bytes) -> None:
        """Body bytes for ``read_chunk``; past the high-water mark the engine's socket is
        paused until they are read."""
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER:
            self._connection.pause_reading()
        self._wake()

    def _headers_done(
        self, status: int, fields: list[tuple[bytes, bytes]], keep_alive: bool
    ) -> None:
        """The final answer's head (status 200-599); raises ``MalformedResponse`` for one
        pdproxy cannot use, before anything of it is seen."""
        if self._post and status in (204, 304):
            raise MalformedResponse(f"HTTP {status} (no body) as the answer to a POST")
        headers = Headers([(n.decode("latin-1").lower(), v.decode("latin-1")) for n, v in fields])
        coding = headers.get("transfer-encoding")
        if coding is not None and coding.strip().lower() != "chunked":
            # pdproxy sends no TE: chunked is the only transfer coding it may be sent
            raise MalformedResponse("the answer's transfer coding is not chunked")
        self._decoder = decoder_for(headers.get("content-encoding"))
        self.status, self.headers, self._keep_alive = status, headers, keep_alive
        self._framed = coding is not None or "content-length" in headers
        self._wake()

    def _finish(self) -> None:
        self.complete = True
        self._wake()

    def _fail(self, error: HTTPError) -> None:
        if not self.complete and self._error is None:
            self._error = error
            self._wake()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(ReadTimeout("the engine stayed silent past the read timeout"))
