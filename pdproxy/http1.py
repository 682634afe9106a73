"""A pooled HTTP/1.1 client for the request legs, on httptools' parser (uvicorn's).

The legs are the hot path: aiohttp's client spends about 400 Python calls on each request
(URL, header multidicts, cookie jar, timers, payload registry, tracing hooks) and a dozen per
body read, a third of pdproxy's CPU per short request (docs/benchmarks.md, issue 12). The
legs need much less: one request at a time per connection, a bytes body with a
``Content-Length``, answers framed by ``Content-Length``, chunked encoding or the
connection's end, keep-alive with a bounded idle time, and limits per pool and per host.

Only ``pdproxy.engine_client`` uses it; it maps these exceptions to ``pdproxy.errors``.
``ConnectFailed`` means nothing reached the engine (the retry-safety the orchestrator needs).
"""

from __future__ import annotations

import asyncio
import ssl
import sys
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from typing import cast
from urllib.parse import urlsplit

import httptools

if sys.version_info >= (3, 11):
    # Not wait_for: in 3.11 it swallows a cancellation that lands as the connect completes.
    from asyncio import timeout as _timeout
else:  # pragma: no cover - aiohttp depends on async-timeout below 3.11
    from async_timeout import timeout as _timeout

_HIGH_WATER = 256 * 1024  # body bytes buffered before the engine's socket is paused
_URL_CACHE = 1024


class HTTPError(Exception):
    """Base of this client's failures."""


class ConnectFailed(HTTPError):
    """The connection could not be made (refused, unreachable, TLS handshake): nothing was
    sent. ``tls`` is the handshake's failure when that is what failed."""

    def __init__(self, message: str, tls: ssl.SSLError | None = None) -> None:
        super().__init__(message)
        self.tls = tls


class ConnectTimeout(ConnectFailed):
    """Connecting took longer than the connect timeout."""


class ReadTimeout(HTTPError):
    """The engine stayed silent past the read timeout, or the answer missed its deadline."""


class ConnectionBroken(HTTPError):
    """The connection ended or broke before the answer was whole (the OS's or TLS's error,
    if any, is the ``__cause__``)."""


class MalformedResponse(HTTPError):
    """The engine's bytes are not an HTTP/1.1 answer."""


class _Target:
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

    def __init__(self, connection: _Connection, deadline: float | None) -> None:
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
            self._connection.pool.release(self._connection)
        else:
            self.close()

    def close(self) -> None:
        """Abandon the answer: the connection is closed (vLLM aborts the request)."""
        if not self._done:
            self._done = True
            self._connection.pool.discard(self._connection)

    # --- fed by the connection ---

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

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


def _no_turn(turn: asyncio.Future[None]) -> None:
    if not turn.done():
        turn.set_exception(ReadTimeout("no upstream connection became free in time"))


class _Connection(asyncio.Protocol):
    """One connection to an engine, one request at a time."""

    def __init__(self, pool: Pool, key: tuple[bool, str, int]) -> None:
        self.pool = pool
        self.key = key
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.response: Response | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._header_list: list[tuple[bytes, bytes]] = []

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
            response._fail(MalformedResponse(f"malformed HTTP answer ({exc})"))
            self.close()

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


class Pool:
    """Keep-alive connections per (scheme, host, port), reused most recent first, idle at
    most ``keepalive_expiry`` seconds; at most ``limit`` in use (``limit_per_host`` per
    host; 0: no limit), further requests waiting their turn."""

    def __init__(
        self,
        *,
        limit: int,
        limit_per_host: int,
        keepalive_expiry: float,
        connect_timeout: float | None,
        ssl_context: ssl.SSLContext | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self._limit = limit
        self._limit_per_host = limit_per_host
        self._expiry = keepalive_expiry
        self._connect_timeout = connect_timeout
        self._ssl = ssl_context
        self._clock = clock
        self._idle: dict[tuple[bool, str, int], deque[_Connection]] = defaultdict(deque)
        self._in_use: set[_Connection] = set()
        self._per_host: dict[tuple[bool, str, int], int] = defaultdict(int)
        self._connecting = 0
        self._queue: deque[asyncio.Future[None]] = deque()
        self._targets: dict[str, _Target] = {}

    def in_use(self) -> int:
        return len(self._in_use)

    async def request(
        self,
        method: str,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        headers_within: float | None,
        total: float | None = None,
    ) -> Response:
        """Send the request; return once the answer's status and headers are in, at most
        ``headers_within`` seconds from now (a free connection, connecting and the wait
        included), and ``total`` for the whole answer if given."""
        target = self._target(url)
        now = self.loop.time()
        deadline = None if total is None else now + total
        headers_by = None if headers_within is None else now + headers_within
        if deadline is not None:
            headers_by = deadline if headers_by is None else min(headers_by, deadline)
        head = _head(method, target, headers, len(body))
        connection = await self._acquire(target, headers_by)
        response = Response(connection, deadline)
        try:
            connection.send(head + body if body else head, response)
            await response._wait_headers(headers_by)
        except BaseException:
            response.close()
            raise
        return response

    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) >= _URL_CACHE:
                self._targets.clear()
            target = self._targets[url] = _Target(url)
        return target

    async def _acquire(self, target: _Target, by: float | None) -> _Connection:
        key = target.key
        while True:
            idle = self._idle.get(key)
            now = self._clock()
            while idle:
                connection = idle.pop()
                if connection.closed or now - connection.idle_since > self._expiry:
                    connection.close()
                    continue
                self._take(connection)
                return connection
            if self._has_room(key):
                break
            await self._wait_turn(by)
        return await self._connect(target, by)

    async def _wait_turn(self, by: float | None) -> None:
        """Wait for a connection to be given back (every limit reached)."""
        turn = self.loop.create_future()
        self._queue.append(turn)
        timer = None if by is None else self.loop.call_at(by, _no_turn, turn)
        try:
            await turn
        except BaseException:
            if turn.done() and not turn.cancelled() and turn.exception() is None:
                self._next_turn()  # given a turn it cannot take: the next one's
            raise
        finally:
            if timer is not None:
                timer.cancel()
            if turn in self._queue:
                self._queue.remove(turn)

    def _has_room(self, key: tuple[bool, str, int]) -> bool:
        used = len(self._in_use) + self._connecting
        if self._limit and used >= self._limit:
            return False
        return not (self._limit_per_host and self._per_host[key] >= self._limit_per_host)

    async def _connect(self, target: _Target, by: float | None) -> _Connection:
        key = target.key
        self._connecting += 1
        self._per_host[key] += 1
        timeout = self._connect_timeout
        if by is not None:
            left = max(by - self.loop.time(), 0.0)
            timeout = left if timeout is None else min(timeout, left)
        try:
            async with _timeout(timeout):
                transport, connection = await self.loop.create_connection(
                    lambda: _Connection(self, key),
                    target.host,
                    target.port,
                    ssl=self._tls_context() if target.tls else None,
                    server_hostname=target.host if target.tls else None,
                )
        except asyncio.TimeoutError as exc:
            self._uncount(key)
            raise ConnectTimeout(f"connecting took over {timeout:g} s") from exc
        except ssl.SSLError as exc:
            self._uncount(key)
            raise ConnectFailed("TLS handshake failed", tls=exc) from exc
        except OSError as exc:
            self._uncount(key)
            raise ConnectFailed(f"cannot connect ({exc.strerror or exc})") from exc
        except BaseException:
            self._uncount(key)
            raise
        self._connecting -= 1
        # uvloop may run connection_made after create_connection has returned
        connection.transport = transport
        self._in_use.add(connection)
        return connection

    def _tls_context(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = ssl.create_default_context()  # the system's CAs, names checked
        return self._ssl

    def _uncount(self, key: tuple[bool, str, int]) -> None:
        self._connecting -= 1
        self._per_host[key] -= 1
        self._next_turn()

    def _take(self, connection: _Connection) -> None:
        self._in_use.add(connection)
        self._per_host[connection.key] += 1

    def _give_back(self, connection: _Connection) -> bool:
        if connection not in self._in_use:
            return False
        self._in_use.discard(connection)
        self._per_host[connection.key] -= 1
        self._next_turn()
        return True

    def _next_turn(self) -> None:
        while self._queue:
            turn = self._queue.popleft()
            if not turn.done():
                turn.set_result(None)
                return

    def release(self, connection: _Connection) -> None:
        """A whole answer was read: the connection waits for the next request."""
        if self._give_back(connection):
            connection.response = None
            if connection.closed:
                return
            now = connection.idle_since = self._clock()
            idle = self._idle[connection.key]
            idle.append(connection)
            # Reuse is most recent first: the oldest are closed here once past the expiry.
            while now - idle[0].idle_since > self._expiry:
                idle.popleft().close()

    def discard(self, connection: _Connection) -> None:
        """The connection is closed and forgotten."""
        connection.close()
        self._give_back(connection)

    def lost(self, connection: _Connection) -> None:
        """The connection ended (either side): an idle one leaves the pool."""
        idle = self._idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)

    def close(self) -> None:
        """Close every connection, idle or in use."""
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()
        for connection in list(self._in_use):
            self.discard(connection)


def _head(method: str, target: _Target, headers: Mapping[str, str], length: int) -> bytes:
    lines = [method, target.head]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} has a line break")
        lines.append(f"{name}: {value}\r\n")
    if length or method == "POST":
        lines.append(f"Content-Length: {length}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")
