"""One keep-alive connection to an engine (an asyncio protocol on httptools' parser) and
the answer it is reading (``Response``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools

from pdproxy.http1.errors import ConnectionBroken, HTTPError, MalformedResponse, ReadTimeout

_HIGH_WATER = 256 * 1024  # body bytes buffered before the engine's socket is paused


class Owner(Protocol):
    """The pool a connection belongs to."""

    loop: asyncio.AbstractEventLoop

    def release(self, connection: Connection) -> None: ...

    def discard(self, connection: Connection) -> None: ...

    def lost(self, connection: Connection) -> None: ...


class Target:
    __slots__ = ("head", "host", "key", "port", "tls")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.key = (self.tls, self.host, self.port)
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        host = f"[{self.host}]" if ":" in self.host else self.host  # IPv6
        if parts.port:
            host += f":{parts.port}"
        self.head = f" {target} HTTP/1.1\r\nHost: {host}\r\n"  # never the URL's userinfo


class Response:
    """An answer whose status and headers have arrived; its body is read with
    ``read_chunk``/``read_all``, then the connection is ``release()``d or ``close()``d."""

    def __init__(self, connection: Connection, deadline: float | None) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}  # names in lower case; a repeated one: the last
        self.complete = False
        self._connection = connection
        self._loop = connection.loop
        self._deadline = deadline  # loop time the whole answer must be in by
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._error: HTTPError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._keep_alive = False
        self._framed = False  # a length or chunked: else the body ends with the connection
        self._done = False  # released or closed
        self._sink: Callable[[bytes], bool] | None = None  # push_to's

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
        """Until the status and headers are in, at the latest at loop time ``by``."""
        while not self.status:
            if self._error is not None:
                raise self._error
            timeout = None if by is None else by - self._loop.time()
            if timeout is not None and timeout <= 0:
                raise ReadTimeout("the engine's answer did not start in time")
            await self._wait(timeout)

    async def read_chunk(self, timeout: float | None = None) -> bytes:
        """Whatever body bytes have arrived (waiting at most ``timeout`` for some); b"" once
        the body is whole."""
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                if self._buffered > _HIGH_WATER:
                    self._connection.resume_reading()
                self._buffered = 0
                return data
            if self._error is not None:
                raise self._error
            if self.complete:
                return b""
            await self._wait(timeout)

    def push_to(self, sink: Callable[[bytes], bool] | None) -> None:
        """While set, body bytes are handed to ``sink`` in the connection's own callback as
        they arrive (the pieces of one read joined), before any reader waits for them;
        ``sink`` returns False to decline them, and they are then buffered (with all that
        follows) for ``read_chunk`` as usual. Bytes already buffered come first: none are
        offered while some wait."""
        self._sink = sink

    async def read_all(self, timeout: float | None = None) -> bytes:
        """The whole body, each silence at most ``timeout``."""
        parts = []
        while chunk := await self.read_chunk(timeout):
            parts.append(chunk)
        return b"".join(parts)

    def release(self) -> None:
        """Done with a whole body: the connection is pooled again (if it can be reused)."""
        if self._done:
            return
        if self.complete and self._keep_alive and self._error is None:
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
        if self._buffered > _HIGH_WATER:
            self._connection.pause_reading()
        self._wake()

    def _headers_done(self, status: int, headers: dict[str, str], keep_alive: bool) -> None:
        self.status, self.headers, self._keep_alive = status, headers, keep_alive
        self._framed = "content-length" in headers or "transfer-encoding" in headers
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


class Connection(asyncio.Protocol):
    """One connection to an engine, one request at a time."""

    def __init__(self, pool: Owner, key: tuple[bool, str, int]) -> None:
        self.pool = pool
        self.key = key
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.response: Response | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._header_list: list[tuple[bytes, bytes]] = []
        self._pushed: list[bytes] = []  # body pieces of this read, for the response's sink

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None or response.complete:  # nothing was asked: unusable
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self._pushed:
                self._offer_pushed(response)
            response._fail(MalformedResponse(f"malformed HTTP answer ({exc})"))
            self.close()
            return
        if self._pushed:
            self._offer_pushed(response)

    def _offer_pushed(self, response: Response) -> None:
        """The body pieces this read brought, joined, to the sink: one write for the tokens
        of one read, as ``read_chunk`` joins them; buffered if it declines."""
        pushed = self._pushed
        data = pushed[0] if len(pushed) == 1 else b"".join(pushed)
        pushed.clear()
        sink = response._sink
        if sink is None or not sink(data):
            response._feed(data)

    def eof_received(self) -> bool:
        response = self.response
        if response is not None and response.status and not response._framed:
            response._keep_alive = False
            response._finish()  # a body delimited by the connection's end
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self.response
        if response is not None:
            error = ConnectionBroken("the engine closed the connection before answering whole")
            error.__cause__ = exc
            response._fail(error)
        self.pool.lost(self)

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def send(self, data: bytes, response: Response) -> None:
        assert self.transport is not None
        self.response = response
        self.transport.write(data)

    # --- httptools callbacks ---

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_list.append((name, value))

    def on_headers_complete(self) -> None:
        if self.response is None or self.response.status:  # a second answer to one request
            self.response = None
            self.close()
            return
        headers = {n.decode("latin-1").lower(): v.decode("latin-1") for n, v in self._header_list}
        self._header_list.clear()
        parser = self._parser
        self.response._headers_done(parser.get_status_code(), headers, parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        response = self.response
        if response is not None:  # Response._feed, inlined: once per streamed token
            if response._sink is not None and not response._chunks:
                self._pushed.append(body)  # offered once the whole read is parsed
                return
            response._chunks.append(body)
            response._buffered += len(body)
            if response._buffered > _HIGH_WATER:
                self.pause_reading()
            waiter = response._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def on_message_complete(self) -> None:
        if self.response is not None:
            self.response._finish()
