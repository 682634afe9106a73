"""A lean HTTP/1.1 server protocol on httptools, with direct control over the TCP connection.

The sim needs things an ASGI server hides: abort the socket mid-response, notice a peer's
close at once (connection_lost), and serve a request inline without a task.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import httptools

HIGH_WATER = 256 * 1024
_REASONS = {s.value: s.phrase for s in HTTPStatus}
_LINGER_ZERO = struct.pack("ii", 1, 0)  # l_onoff=1, l_linger=0: close() sends an RST


@dataclass
class Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    conn: Connection
    keep_alive: bool = True


@dataclass
class ServerState:
    """Shared by all connections of one server; owned by the server, never a global."""

    handler: Callable[[Request], None]
    keep_alive_s: float
    connections: set[Connection] = field(default_factory=set)
    stopping: bool = False


class Connection(asyncio.Protocol):
    """One client TCP connection; requests are answered one at a time, in order."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.closed = False
        self.task: asyncio.Task[Any] | None = None
        self.on_lost: Callable[[], None] | None = None
        self._pending: deque[Request] = deque()
        self._busy = False
        self._keep_alive = True
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._idle: asyncio.TimerHandle | None = None
        self._writable: asyncio.Future[None] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        self.state.connections.add(self)
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.state.connections.discard(self)
        self._cancel_idle()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        if self.on_lost is not None:
            self.on_lost()
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        self._cancel_idle()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.send(400, b"upgrade not supported", "text/plain", close=True)
        except httptools.HttpParserError:
            self.send(400, b"invalid HTTP request", "text/plain", close=True)

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._url, self._headers, self._body = b"", {}, []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self._headers.get("expect", "").lower() == "100-continue" and self.transport:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        path, _, query = self._url.decode("latin-1").partition("?")
        method = self.parser.get_method().decode()
        req = Request(method, path, query, self._headers, b"".join(self._body), self)
        req.keep_alive = self.parser.should_keep_alive()
        self._pending.append(req)
        if not self._busy:
            self._next()

    # response API for handlers
    def send(
        self,
        status: int,
        body: bytes,
        content_type: str = "application/json",
        headers: tuple[tuple[str, str], ...] = (),
        close: bool = False,
    ) -> None:
        """Write one complete response and move on to the next request."""
        if self.closed or self.transport is None:
            return
        head = self._head(status, content_type, headers, close)
        self.transport.write(b"%sContent-Length: %d\r\n\r\n%s" % (head, len(body), body))
        self._finish(close)

    def start_stream(self, status: int = 200, content_type: str = "text/event-stream") -> None:
        if self.closed or self.transport is None:
            return
        head = self._head(status, content_type, (), False)
        self.transport.write(head + b"Transfer-Encoding: chunked\r\n\r\n")

    def write_chunk(self, data: bytes) -> None:
        if not self.closed and self.transport is not None and data:
            self.transport.write(b"%x\r\n%s\r\n" % (len(data), data))

    def end_stream(self) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(b"0\r\n\r\n")
            self._finish(False)

    async def drain(self) -> None:
        """Wait while the client reads slower than we write."""
        if self._writable is not None:
            await self._writable

    def abort(self) -> None:
        """Drop the TCP connection abruptly (RST where the OS allows)."""
        if self.transport is not None:
            self.transport.abort()

    def reset(self) -> None:
        """Drop the TCP connection with an RST (SO_LINGER 0), as a crashed peer's kernel may."""
        if self.transport is None:
            return
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed: abort() is all that is left
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_ZERO)
        self.transport.abort()

    def send_truncated(
        self, status: int, body: bytes, limit: int, content_type: str = "application/json"
    ) -> None:
        """Announce the whole body, send its first `limit` bytes, then reset the connection."""
        if self.closed or self.transport is None:
            return
        head = self._head(status, content_type, (), False)
        self.transport.write(b"%sContent-Length: %d\r\n\r\n%s" % (head, len(body), body[:limit]))
        self.reset()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a request's coroutine as this connection's task (cancelled on disconnect)."""
        self.task = asyncio.get_running_loop().create_task(coro)

    # internals
    def _head(
        self, status: int, content_type: str, headers: tuple[tuple[str, str], ...], close: bool
    ) -> bytes:
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers)
        conn = "Connection: close\r\n" if close or not self._keep_alive else ""
        reason = _REASONS.get(status, "Unknown")
        return (
            f"HTTP/1.1 {status} {reason}\r\nserver: uvicorn\r\n"
            f"Content-Type: {content_type}\r\n{conn}{extra}"
        ).encode("latin-1")

    def _next(self) -> None:
        while self._pending and not self._busy and not self.closed:
            req = self._pending.popleft()
            self._busy = True
            self._keep_alive = req.keep_alive
            self.task = None
            self.on_lost = None
            self.state.handler(req)

    def _finish(self, close: bool) -> None:
        self._busy = False
        self.on_lost = None
        if close or not self._keep_alive:
            assert self.transport is not None
            self.transport.close()
            return
        if self._pending:
            self._next()
        else:
            self._arm_idle()

    def _arm_idle(self) -> None:
        if self.state.keep_alive_s > 0 and self.transport is not None:
            loop = asyncio.get_running_loop()
            self._idle = loop.call_later(self.state.keep_alive_s, self._idle_close)

    def _cancel_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None

    def _idle_close(self) -> None:
        if not self._busy and self.transport is not None:
            self.transport.close()
