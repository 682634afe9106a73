"""``Pool``: keep-alive connections per engine, their expiry and limits, and sending a
request on one.

A request waiting for a connection (``limit`` or ``limit_per_host`` reached) waits in its
host's queue; a freed slot wakes the longest-waiting request that can take it, so a host at
its own cap never swallows the turn of another host's request."""

from __future__ import annotations

import asyncio
import itertools
import ssl
import sys
import time
from collections import defaultdict, deque
from collections.abc import Callable, Mapping

from pdproxy.upstream.http1.connection import Connection, Target
from pdproxy.upstream.http1.errors import ConnectFailed, ConnectTimeout, HTTPError, ReadTimeout
from pdproxy.upstream.http1.response import Response

if sys.version_info >= (3, 11):
    # Not wait_for: in 3.11 it swallows a cancellation that lands as the connect completes.
    from asyncio import timeout as _timeout
else:  # pragma: no cover - aiohttp depends on async-timeout below 3.11
    from async_timeout import timeout as _timeout

_URL_CACHE = 1024
MAX_BODY = 256 * 1024 * 1024  # the default cap on a buffered body (PoolLimits')
_Key = tuple[bool, str, int]
_Turn = tuple[int, asyncio.Future[None]]  # (its place in the order of arrival, its wake-up)


class Pool:
    """Keep-alive connections per (scheme, host, port), reused most recent first, idle at
    most ``keepalive_expiry`` seconds; at most ``limit`` in use (``limit_per_host`` per
    host; 0: no limit), further requests waiting their turn. A body read whole
    (``Response.read_all``) is refused past ``max_body`` bytes."""

    def __init__(
        self,
        *,
        limit: int,
        limit_per_host: int,
        keepalive_expiry: float,
        connect_timeout: float | None,
        ssl_context: ssl.SSLContext | None,
        max_body: int = MAX_BODY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self._limit = limit
        self._limit_per_host = limit_per_host
        self._expiry = keepalive_expiry
        self._connect_timeout = connect_timeout
        self._ssl = ssl_context
        self._max_body = max_body
        self._clock = clock
        self._idle: dict[_Key, deque[Connection]] = defaultdict(deque)
        self._in_use: set[Connection] = set()
        self._per_host: dict[_Key, int] = defaultdict(int)
        self._connecting = 0
        self._waiting: dict[_Key, deque[_Turn]] = {}  # per host, in order of arrival
        self._arrivals = itertools.count()
        self._targets: dict[str, Target] = {}
        self._opening: dict[_Key, int] = defaultdict(int)  # ``prepare``'s connects under way
        self._preparing: set[asyncio.Task[None]] = set()

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
        response = Response(connection, deadline, post=method == "POST", limit=self._max_body)
        try:
            connection.send(head + body if body else head, response)
            await response._wait_headers(headers_by)
        except BaseException:
            response.close()
            raise
        return response

    def prepare(self, url: str, wanted: int) -> None:
        """Start opening connections to ``url``'s host in the background until ``wanted``
        are idle or being opened there (within the caps), so that requests known to come
        (a decode leg whose prefill is running) find one made. A connect that fails is
        forgotten: the request that needs the host connects itself and meets the error."""
        target = self._target(url)
        key = target.key
        idle = self._idle.get(key)
        missing = wanted - (len(idle) if idle else 0) - self._opening[key]
        while missing > 0 and self._has_room(key):
            missing -= 1
            self._opening[key] += 1
            task = self.loop.create_task(self._open_idle(target))
            self._preparing.add(task)
            task.add_done_callback(self._preparing.discard)

    async def _open_idle(self, target: Target) -> None:
        try:
            connection = await self._connect(target, None)
        except (OSError, HTTPError):
            return
        finally:
            self._opening[target.key] -= 1
        self.release(connection)  # idle from now, as if it had served an answer

    def _target(self, url: str) -> Target:
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) >= _URL_CACHE:
                self._targets.clear()
            target = self._targets[url] = Target(url)
        return target

    async def _acquire(self, target: Target, by: float | None) -> Connection:
        key = target.key
        arrival: int | None = None
        while True:
            idle = self._idle.get(key)
            now = self._clock()
            while idle:
                connection = idle.pop()
                if now - connection.idle_since > self._expiry or not connection.quiet():
                    connection.close()  # expired, closed, or the engine wrote or hung up
                    continue
                self._take(connection)
                return connection
            if self._has_room(key):
                break
            arrival = await self._wait_turn(key, by, arrival)
        return await self._connect(target, by)

    async def _wait_turn(self, key: _Key, by: float | None, arrival: int | None) -> int:
        """Wait in ``key``'s queue until a slot it can take is freed; returns its place in
        the order of arrival, kept (at the head of its queue) if it must wait again."""
        turn = self.loop.create_future()
        queue = self._waiting.setdefault(key, deque())
        if arrival is None:
            arrival = next(self._arrivals)
            queue.append(entry := (arrival, turn))
        else:  # woken, but the slot was taken before it ran: first again
            queue.appendleft(entry := (arrival, turn))
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
            self._leave_queue(key, entry)
        return arrival

    def _leave_queue(self, key: _Key, entry: _Turn) -> None:
        queue = self._waiting.get(key)
        if queue is None:
            return
        if entry in queue:
            queue.remove(entry)
        if not queue:
            del self._waiting[key]

    def _has_room(self, key: _Key) -> bool:
        used = len(self._in_use) + self._connecting
        if self._limit and used >= self._limit:
            return False
        return not (self._limit_per_host and self._per_host[key] >= self._limit_per_host)

    async def _connect(self, target: Target, by: float | None) -> Connection:
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
                    lambda: Connection(self, key),
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

    def _uncount(self, key: _Key) -> None:
        self._connecting -= 1
        self._per_host[key] -= 1
        self._next_turn()

    def _take(self, connection: Connection) -> None:
        self._in_use.add(connection)
        self._per_host[connection.key] += 1

    def _give_back(self, connection: Connection) -> bool:
        if connection not in self._in_use:
            return False
        self._in_use.discard(connection)
        self._per_host[connection.key] -= 1
        self._next_turn()
        return True

    def _next_turn(self) -> None:
        """Wake the longest-waiting request that can go now: an idle connection to its
        host, or room under both caps (one host at its own cap holds only its own)."""
        first: deque[_Turn] | None = None
        for key, queue in self._waiting.items():
            while queue and queue[0][1].done():  # timed out or cancelled: leaving
                queue.popleft()
            if not queue or (first is not None and queue[0][0] > first[0][0]):
                continue
            if self._idle.get(key) or self._has_room(key):
                first = queue
        if first is not None:
            first.popleft()[1].set_result(None)

    def release(self, connection: Connection) -> None:
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

    def discard(self, connection: Connection) -> None:
        """The connection is closed and forgotten."""
        connection.close()
        self._give_back(connection)

    def lost(self, connection: Connection) -> None:
        """The connection ended (either side): an idle one leaves the pool."""
        idle = self._idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)

    def close(self) -> None:
        """Close every connection, idle or in use."""
        for task in self._preparing:
            task.cancel()
        for idle in self._idle.values():
            for connection in idle:
                connection.close()
        self._idle.clear()
        for connection in list(self._in_use):
            self.discard(connection)


def _head(method: str, target: Target, headers: Mapping[str, str], length: int) -> bytes:
    lines = [method, target.head]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} has a line break")
        lines.append(f"{name}: {value}\r\n")
    if length or method == "POST":
        lines.append(f"Content-Length: {length}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("latin-1")


def _no_turn(turn: asyncio.Future[None]) -> None:
    if not turn.done():
        turn.set_exception(ReadTimeout("no upstream connection became free in time"))
