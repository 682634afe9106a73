"""The two readers of tests/unit/test_http1_differential.py: one engine answer, delivered in
pieces, read by pdproxy's legs' client (``pdproxy.upstream.http1.Pool`` over an in-memory transport)
and by h11's client side (the reference), each reduced to a ``Verdict``.

A ``Verdict`` is the framing of the answer, not its headers: a message (its final status, its
body, whether the connection could carry a next request), an error, or ``incomplete`` (the
reader still waits when the engine has sent all it will). When the connection is reusable,
both readers ask a second request on it and read ``NEXT_ANSWER`` there: the verdict records
what came back, so trailers or unread bytes left on a pooled connection show.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import h11

from pdproxy.upstream import http1

URL = "http://engine.test:8000/v1/completions"
REQUEST_BODY = b'{"prompt":"x"}'
NEXT_ANSWER = b"HTTP/1.1 200 OK\r\nX-Next: 1\r\nContent-Length: 4\r\n\r\nnext"
NEXT = (200, b"next", ("content-length", "x-next"))
# h11's bound on a head (and on a chunk header or trailers) still incomplete: pdproxy's own
# caps on a head are at most this (the test's rules name where pdproxy's are stricter).
H11_MAX_HEAD = 64 * 1024
# loop turns without a delivery before an unfinished reader counts as waiting (a coded
# body decodes a piece per turn: enough for any body under the test's cap)
_SETTLE = 64
_MAX_TURNS = 20_000  # a reader still busy after this many loop turns is a hang


@dataclass(frozen=True)
class Exchange:
    """One engine answer: the bytes it sends (``pieces``, each followed by ``turns[i]`` loop
    turns before the next, so the reader may run in between) and whether it then closes."""

    pieces: tuple[bytes, ...]
    turns: tuple[int, ...] = ()
    close: bool = False
    method: Literal["POST", "GET"] = "POST"

    @functools.cached_property
    def data(self) -> bytes:
        return b"".join(self.pieces)


@dataclass(frozen=True)
class Verdict:
    """``kind``: ``message``, ``error`` or ``incomplete``; for a message, its final status,
    body, and (when the connection was reusable) what a next request on it read."""

    kind: Literal["message", "error", "incomplete"]
    status: int = 0
    body: bytes = b""
    reusable: bool = False
    next: tuple[int, bytes, tuple[str, ...]] | str | None = None
    raised: str = ""  # an exception out of a protocol callback (the transport then aborts)
    detail: str = field(default="", compare=False)
    leftover: bytes = field(default=b"", compare=False)  # h11's: bytes after the message

    def __str__(self) -> str:
        raised = f" [a callback raised {self.raised}]" if self.raised else ""
        if self.kind != "message":
            return (f"{self.kind} ({self.detail})" if self.detail else self.kind) + raised
        body = self.body if len(self.body) <= 40 else self.body[:40] + b"..."
        reuse = f"reusable, next: {self.next}" if self.reusable else "not reusable"
        return f"message {self.status} body={body!r} {reuse}{raised}"


# --- the reference: h11's client side ---


def _h11_request(method: str) -> list[h11.Event]:
    headers = [("Host", "engine.test:8000")]
    if method == "GET":
        return [
            h11.Request(method=method, target="/v1/models", headers=headers),
            h11.EndOfMessage(),
        ]
    headers.append(("Content-Length", str(len(REQUEST_BODY))))
    return [
        h11.Request(method=method, target="/v1/completions", headers=headers),
        h11.Data(data=REQUEST_BODY),
        h11.EndOfMessage(),
    ]


def _h11_read(conn: h11.Connection, pieces: Iterable[bytes], close: bool) -> Verdict:
    """Feed the answer; skip interim 1xx, as h11 does, and read the final one."""
    status, body = 0, []
    done = False
    feeds = [*pieces, b""] if close else list(pieces)
    try:
        for piece in feeds:
            conn.receive_data(piece)
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA or event is h11.PAUSED:
                    break
                if isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    body.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    done = True
                elif isinstance(event, h11.ConnectionClosed):
                    break
    except h11.RemoteProtocolError as exc:
        if not done:
            return Verdict("error", detail=str(exc))
        # bytes after a whole answer on a connection that must close: the answer stands
        return Verdict("message", status, b"".join(body), leftover=b"<after the end>")
    if not done:
        return Verdict("incomplete", detail=f"h11 state {conn.their_state}")
    leftover, closed = conn.trailing_data
    reusable = conn.our_state is conn.their_state is h11.DONE and not leftover and not closed
    return Verdict("message", status, b"".join(body), reusable, leftover=bytes(leftover))


def _h11_next(conn: h11.Connection) -> tuple[int, bytes, tuple[str, ...]] | str:
    conn.start_next_cycle()
    for event in _h11_request("POST"):
        conn.send(event)
    conn.receive_data(NEXT_ANSWER)
    status, body = 0, b""
    names: tuple[str, ...] = ()
    try:
        while (got := conn.next_event()) is not h11.NEED_DATA:
            event = cast(h11.Event, got)
            if isinstance(event, h11.Response):
                status = event.status_code
                names = tuple(sorted({n.decode("latin-1") for n, _ in event.headers}))
            elif isinstance(event, h11.Data):
                body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return status, body, names
    except h11.RemoteProtocolError:
        return "error"
    return "incomplete"


def h11_verdict(exchange: Exchange) -> Verdict:
    """The reference verdict: h11's client, its head bound ``H11_MAX_HEAD``."""
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=H11_MAX_HEAD)
    for event in _h11_request(exchange.method):
        conn.send(event)
    verdict = _h11_read(conn, exchange.pieces, exchange.close)
    if verdict.kind == "message" and verdict.reusable:
        return Verdict("message", verdict.status, verdict.body, True, _h11_next(conn))
    return verdict


# --- pdproxy: the legs' pool, on a scripted in-memory transport ---


class _Transport(asyncio.Transport):
    """What the engine's socket would do: the answer arrives in the exchange's pieces (one
    ``data_received`` each, loop turns between), reading pauses and resumes, ``close`` ends
    in ``connection_lost`` on a later turn, an end of stream in ``eof_received``."""

    def __init__(self, engine: _Engine, protocol: asyncio.Protocol) -> None:
        super().__init__()
        self.engine = engine
        self.protocol = protocol
        self.requests = 0
        self.closed = False
        self.paused = False
        self._pending = b""

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self.closed:
            return
        self._pending += bytes(data)
        if self._pending.endswith(b"\r\n\r\n") or self._pending.endswith(REQUEST_BODY):
            self._pending = b""
            self.requests += 1
            self.engine.answer(self)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def abort(self) -> None:
        self.close()

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def is_reading(self) -> bool:
        return not self.paused

    async def deliver(self, pieces: Iterable[bytes], turns: Iterable[int], close: bool) -> None:
        for piece, after in zip(pieces, turns, strict=True):
            for _ in range(_MAX_TURNS):
                if not self.paused or self.closed:
                    break
                await asyncio.sleep(0)
            if self.closed:
                return
            try:
                self.protocol.data_received(piece)
            except Exception as exc:  # what asyncio's transports do: log, abort
                self.engine.raised.append(f"{type(exc).__name__}: {exc}")
                self.closed = True
                self.protocol.connection_lost(exc)
                return
            for _ in range(after):
                await asyncio.sleep(0)
        if close and not self.closed and not self.protocol.eof_received():
            self.close()


class _Engine:
    """Answers the first request on the first connection with the exchange, every other
    request with ``NEXT_ANSWER``; remembers the connections it served."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.transports: list[_Transport] = []
        self.raised: list[str] = []
        self.deliveries: set[asyncio.Task[None]] = set()

    def answer(self, transport: _Transport) -> None:
        exchange = self.exchange
        if transport is self.transports[0] and transport.requests == 1:
            turns = exchange.turns or (1,) * len(exchange.pieces)
            job = transport.deliver(exchange.pieces, turns, exchange.close)
        else:
            job = transport.deliver((NEXT_ANSWER,), (1,), False)
        task = asyncio.get_running_loop().create_task(job)
        self.deliveries.add(task)
        task.add_done_callback(self.deliveries.discard)


class _Network:
    """The running loop, except that ``create_connection`` reaches ``_Engine``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, engine: _Engine) -> None:
        self._loop = loop
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loop, name)

    async def create_connection(
        self, factory: Any, host: str, port: int, **kwargs: Any
    ) -> tuple[_Transport, asyncio.Protocol]:
        protocol = factory()
        transport = _Transport(self._engine, protocol)
        self._engine.transports.append(transport)
        protocol.connection_made(transport)
        return transport, protocol


def _names(headers: Any) -> tuple[str, ...]:
    """The field names of an answer, in lower case, each once."""
    fields = headers.items() if hasattr(headers, "items") else headers
    return tuple(sorted({str(name).lower() for name, _ in fields}))


async def _ask(pool: http1.Pool, method: str) -> tuple[int, bytes, tuple[str, ...]]:
    """One request as pdproxy's legs make it: the head, the whole body, then release."""
    body = REQUEST_BODY if method == "POST" else b""
    headers = {"Content-Type": "application/json"} if body else {}
    response = await pool.request(method, URL, body, headers, headers_within=None)
    try:
        data = await response.read_all()
    except BaseException:
        response.close()
        raise
    response.release()
    return response.status, data, _names(response.headers)


async def _settle(engine: _Engine, until: asyncio.Task[Any] | None = None) -> None:
    """Loop turns until ``until`` is done or the engine has sent all and ``_SETTLE`` more
    turns passed (what follows from its last bytes has happened)."""
    quiet = 0
    for _ in range(_MAX_TURNS):
        if until is not None and until.done():
            return
        quiet = 0 if engine.deliveries else quiet + 1
        if quiet > _SETTLE:
            return
        await asyncio.sleep(0)


async def _run(engine: _Engine, pool: http1.Pool, method: str) -> Verdict:
    """The request until it answers, fails, or waits with nothing more coming."""
    task = asyncio.get_running_loop().create_task(_ask(pool, method))
    await _settle(engine, task)
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Verdict("incomplete", detail="pdproxy still waiting")
    try:
        status, body, names = task.result()
    except http1.HTTPError as exc:
        return Verdict("error", detail=f"{type(exc).__name__}: {exc}")
    return Verdict("message", status, body, detail=",".join(names))


def make_pool(**overrides: Any) -> http1.Pool:
    options: dict[str, Any] = dict(
        limit=0, limit_per_host=0, keepalive_expiry=60.0, connect_timeout=None, ssl_context=None
    )
    options.update(overrides)
    return http1.Pool(**options)


async def pdproxy_verdict(exchange: Exchange, **pool_options: Any) -> Verdict:
    """pdproxy's verdict: the answer read through a real ``Pool`` (so release, reuse and
    discard are the pool's own), then a next request to see whether the pool reused the
    connection and what it read there."""
    engine = _Engine(exchange)
    pool = make_pool(**pool_options)
    pool.loop = cast(asyncio.AbstractEventLoop, _Network(pool.loop, engine))
    try:
        verdict = await _read_twice(engine, pool, exchange.method)
    finally:
        pool.close()
        for task in list(engine.deliveries):
            task.cancel()
    if engine.raised:
        return dataclasses.replace(verdict, raised=engine.raised[0])
    return verdict


async def _read_twice(engine: _Engine, pool: http1.Pool, method: str) -> Verdict:
    first = await _run(engine, pool, method)
    if first.kind != "message":
        return first
    await _settle(engine)  # all of the first exchange is in, the end of stream included
    second = await _run(engine, pool, "POST")
    if len(engine.transports) > 1:  # the pool did not reuse the connection
        return Verdict("message", first.status, first.body, False)
    if second.kind != "message":
        got: tuple[int, bytes, tuple[str, ...]] | str = second.kind
    else:
        got = (second.status, second.body, tuple(second.detail.split(",")))
    return Verdict("message", first.status, first.body, True, got)
