"""pdproxy.upstream.http1, the legs' HTTP/1.1 client, against scripted servers on loopback: framing
(content-length, chunked, to the connection's end), keep-alive and pooled reuse, expiry,
half-closes, resets, timeouts, limits and malformed answers."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import uvloop

from pdproxy.upstream import http1

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"
CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Server:
    """Answers each request on each connection with ``script``; counts connections and
    records the requests' bytes."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        self.url = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                self.requests.append(head + await reader.readexactly(length))
                await self.script(reader, writer)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def serving(script: Script) -> AsyncIterator[Server]:
    server = Server(script)
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    server.url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}/v1/completions"
    try:
        yield server
    finally:
        listener.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(listener.wait_closed(), 1)


@contextlib.asynccontextmanager
async def pool(**overrides: float) -> AsyncIterator[http1.Pool]:
    options: dict[str, object] = dict(
        limit=0, limit_per_host=0, keepalive_expiry=4.0, connect_timeout=2.0, ssl_context=None
    )
    options.update(overrides)
    p = http1.Pool(**options)  # type: ignore[arg-type]
    try:
        yield p
    finally:
        p.close()


def answer(data: bytes, *, close: bool = False) -> Script:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(data)
        await writer.drain()
        if close:
            writer.close()

    return script


async def post(p: http1.Pool, url: str, **kw: float | None) -> http1.Response:
    kw.setdefault("headers_within", 2.0)
    return await p.request("POST", url, b'{"a":1}', {"Content-Type": "application/json"}, **kw)


async def test_content_length_answer_and_the_connection_is_reused() -> None:
    async with serving(answer(OK)) as server, pool() as p:
        for _ in range(3):
            response = await post(p, server.url)
            assert response.status == 200
            assert response.headers["content-type"] == "application/json"
            assert await response.read_all(1.0) == b"{}"
            response.release()
        assert server.connections == 1
        assert p.in_use() == 0
        head = server.requests[0]
        assert head.startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
        assert b"\r\nContent-Length: 7\r\n" in head and head.endswith(b'\r\n\r\n{"a":1}')


async def test_chunked_stream_arrives_chunk_by_chunk() -> None:
    gate = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(CHUNKED_HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        await gate.wait()
        writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    async with serving(script) as server, pool() as p:
        response = await post(p, server.url)
        assert await response.read_chunk() == b"data: 1\n\n"
        gate.set()
        assert await response.read_chunk() == b"data: [DONE]\n\n"
        assert await response.read_chunk() == b""
        assert response.complete
        response.release()
        gate.clear()
        gate.set()
        second = await post(p, server.url)
        assert await second.read_all(1.0) == b"data: 1\n\ndata: [DONE]\n\n"
        second.release()
        assert server.connections == 1


async def test_body_to_the_connections_end_is_read_and_not_pooled() -> None:
    data = b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it"
    async with serving(answer(data, close=True)) as server, pool() as p:
        response = await post(p, server.url)
        assert await response.read_all(1.0) == b"all of it"
        response.release()
        again = await post(p, server.url)
        assert await again.read_all(1.0) == b"all of it"
        again.release()
        assert server.connections == 2


async def test_connection_close_answer_is_not_pooled() -> None:
    data = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\n{}"
    async with serving(answer(data)) as server, pool() as p:
        for _ in range(2):
            response = await post(p, server.url)
            assert await response.read_all(1.0) == b"{}"
            response.release()
        assert server.connections == 2


async def test_half_close_before_the_answer_is_broken() -> None:
    async with serving(answer(b"", close=True)) as server, pool() as p:
        with pytest.raises(http1.ConnectionBroken):
            await post(p, server.url)
        assert p.in_use() == 0


async def test_half_close_mid_body_is_broken() -> None:
    short = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this"
    async with serving(answer(short, close=True)) as server, pool() as p:
        response = await post(p, server.url)
        with pytest.raises(http1.ConnectionBroken):
            await response.read_all(1.0)
        response.close()
        assert p.in_use() == 0


async def test_reset_mid_stream_is_broken() -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(CHUNKED_HEAD + chunk(b"data: 1\n\n"))
        await writer.drain()
        await asyncio.sleep(0.05)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # RST

    async with serving(script) as server, pool() as p:
        response = await post(p, server.url)
        assert await response.read_chunk() == b"data: 1\n\n"
        with pytest.raises(http1.ConnectionBroken) as caught:
            await response.read_chunk()
        assert isinstance(caught.value.__cause__, (ConnectionResetError, type(None)))
        response.close()


async def test_refused_connection_is_a_connect_failure() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: refused
        async with pool() as p:
            with pytest.raises(http1.ConnectFailed):
                await post(p, f"http://127.0.0.1:{port}/v1/completions")
            assert p.in_use() == 0


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not within 2 s")


async def test_prepared_connections_are_pooled_and_taken_by_the_next_requests() -> None:
    async with serving(answer(OK)) as server, pool() as p:
        p.prepare(server.url, 2)
        p.prepare(server.url, 2)  # already being opened: no more
        await _until(lambda: server.connections == 2)
        assert p.in_use() == 0
        responses = await asyncio.gather(post(p, server.url), post(p, server.url))
        for response in responses:
            assert await response.read_all(1.0) == b"{}"
            response.release()
        p.prepare(server.url, 2)  # both idle again: nothing to open
        await asyncio.sleep(0.05)
        assert server.connections == 2
        p.prepare(server.url, 3)
        await _until(lambda: server.connections == 3)


async def test_a_prepared_connect_that_fails_is_forgotten() -> None:
    loop = asyncio.get_running_loop()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.setblocking(False)
        url = f"http://127.0.0.1:{s.getsockname()[1]}/v1/completions"
        async with pool() as p:
            p.prepare(url, 1)  # refused: not listening yet
            await asyncio.sleep(0.05)
            assert p.in_use() == 0
            s.listen()
            p.prepare(url, 1)  # the failed attempt is not counted as under way
            accepted, _ = await asyncio.wait_for(loop.sock_accept(s), 2)
            accepted.close()


async def test_idle_connection_past_its_expiry_is_not_reused() -> None:
    async with serving(answer(OK)) as server, pool(keepalive_expiry=0.05) as p:
        for _ in range(2):
            response = await post(p, server.url)
            await response.read_all(1.0)
            response.release()
            await asyncio.sleep(0.1)
        assert server.connections == 2


async def test_oldest_idle_connections_are_closed_once_past_the_expiry() -> None:
    gate = asyncio.Event()

    async def held(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await gate.wait()
        writer.write(OK)
        await writer.drain()

    async with serving(held) as server, pool(keepalive_expiry=0.2) as p:
        burst = [asyncio.create_task(post(p, server.url)) for _ in range(3)]
        await asyncio.sleep(0.05)
        gate.set()
        for response in await asyncio.gather(*burst):
            await response.read_all(1.0)
            response.release()  # three idle connections
        for _ in range(2):  # the most recent one stays fresh; the two below it age
            await asyncio.sleep(0.12)
            response = await post(p, server.url)
            await response.read_all(1.0)
            response.release()
        assert server.connections == 3
        # the two past the expiry were closed as the fresh one came back, not kept forever
        assert sum(len(idle) for idle in p._idle.values()) == 1


async def test_host_header_has_no_userinfo() -> None:
    async with serving(answer(OK)) as server, pool() as p:
        url = server.url.replace("http://", "http://user:secret@")
        response = await post(p, url)
        await response.read_all(1.0)
        response.release()
        assert b"secret" not in server.requests[0]
        assert b"\r\nHost: 127.0.0.1:" in server.requests[0]


async def test_idle_connection_the_engine_closed_leaves_the_pool() -> None:
    async with serving(answer(OK, close=True)) as server, pool() as p:
        response = await post(p, server.url)
        await response.read_all(1.0)
        response.release()  # keep-alive by its headers, but the engine closes it
        await asyncio.sleep(0.05)
        again = await post(p, server.url)
        assert await again.read_all(1.0) == b"{}"
        again.release()
        assert server.connections == 2


async def test_silent_engine_times_out_waiting_for_headers_and_for_the_body() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(5)

    async with serving(silent) as server, pool() as p:
        with pytest.raises(http1.ReadTimeout):
            await post(p, server.url, headers_within=0.05)
        assert p.in_use() == 0

    async def headers_only(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(CHUNKED_HEAD)
        await asyncio.sleep(5)

    async with serving(headers_only) as server, pool() as p:
        response = await post(p, server.url)
        with pytest.raises(http1.ReadTimeout):
            await response.read_chunk(0.05)
        response.close()


async def test_total_deadline_bounds_the_whole_answer() -> None:
    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(CHUNKED_HEAD)
        for _ in range(50):
            writer.write(chunk(b"x"))
            await asyncio.sleep(0.02)

    async with serving(trickle) as server, pool() as p:
        response = await post(p, server.url, total=0.2)
        with pytest.raises(http1.ReadTimeout):
            await response.read_all(1.0)  # each silence is short; the whole is too long
        response.close()


async def test_limit_queues_requests_until_a_connection_is_given_back() -> None:
    async with serving(answer(OK)) as server, pool(limit=1) as p:
        first = await post(p, server.url)
        second = asyncio.create_task(post(p, server.url))
        await asyncio.sleep(0.05)
        assert not second.done()
        assert await first.read_all(1.0) == b"{}"
        first.release()
        response = await asyncio.wait_for(second, 1)
        assert await response.read_all(1.0) == b"{}"
        response.release()
        assert server.connections == 1
        blocked = await post(p, server.url)
        with pytest.raises(http1.ReadTimeout):  # no connection free within the bound
            await post(p, server.url, headers_within=0.05)
        blocked.close()


async def test_a_second_answer_to_one_request_drops_the_connection() -> None:
    async with serving(answer(OK + OK)) as server, pool() as p:
        response = await post(p, server.url)
        assert await response.read_all(1.0) == b"{}"
        response.release()
        again = await post(p, server.url)  # not on the connection that answered twice
        assert await again.read_all(1.0) == b"{}"
        again.release()
        assert server.connections == 2


async def test_malformed_answer() -> None:
    async with serving(answer(b"SMTP ready\r\n\r\n")) as server, pool() as p:
        with pytest.raises(http1.MalformedResponse):
            await post(p, server.url)
        assert p.in_use() == 0


async def test_close_mid_stream_drops_the_connection() -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(CHUNKED_HEAD)
        with contextlib.suppress(ConnectionError):
            while not writer.is_closing():
                writer.write(chunk(b"data: x\n\n"))
                await writer.drain()
                await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)

    async with serving(endless) as server, pool() as p:
        response = await post(p, server.url)
        assert await response.read_chunk()
        response.close()
        assert p.in_use() == 0
        again = await post(p, server.url)
        again.close()
        assert server.connections == 2


async def _pushed(into: list[bytes]) -> None:
    """Until the sink has taken something (at most a second)."""
    for _ in range(200):
        if into:
            return
        await asyncio.sleep(0.005)


async def test_pushed_body_goes_to_the_sink_until_it_declines() -> None:
    gates = [asyncio.Event() for _ in range(3)]

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(CHUNKED_HEAD + chunk(b"data: 0\n\n"))
        for i, gate in enumerate(gates, start=1):
            await gate.wait()
            writer.write(chunk(b"data: %d\n\n" % i))
            await writer.drain()
        writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    taken: list[bytes] = []
    accept = True

    def sink(data: bytes) -> bool:
        if accept:
            taken.append(data)
        return accept

    async with serving(script) as server, pool() as p:
        response = await post(p, server.url)
        assert await response.read_chunk() == b"data: 0\n\n"
        response.push_to(sink)
        gates[0].set()
        await _pushed(taken)
        assert taken == [b"data: 1\n\n"]  # in the callback: nothing for read_chunk
        accept = False
        gates[1].set()
        assert await response.read_chunk() == b"data: 2\n\n"  # declined: buffered, woken
        response.push_to(None)
        gates[2].set()
        assert await response.read_all(1.0) == b"data: 3\n\ndata: [DONE]\n\n"
        response.release()
        assert taken == [b"data: 1\n\n"] and p.in_use() == 0


async def test_the_pieces_of_one_read_reach_the_sink_in_one_call() -> None:
    gate, last = asyncio.Event(), asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(CHUNKED_HEAD + chunk(b"data: 0\n\n"))
        await gate.wait()
        writer.write(chunk(b"data: 1\n\n") + chunk(b"data: 2\n\n"))  # one segment
        await writer.drain()
        await last.wait()
        writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        await writer.drain()

    calls: list[bytes] = []

    def sink(data: bytes) -> bool:
        if data.endswith(b"[DONE]\n\n"):
            return False
        calls.append(data)
        return True

    async with serving(script) as server, pool() as p:
        response = await post(p, server.url)
        assert await response.read_chunk() == b"data: 0\n\n"
        response.push_to(sink)
        gate.set()
        await _pushed(calls)
        last.set()
        assert await response.read_all(1.0) == b"data: [DONE]\n\n"
        assert calls == [b"data: 1\n\ndata: 2\n\n"]  # one write for one read's tokens
        response.release()


async def test_header_with_a_line_break_is_refused_before_sending() -> None:
    async with serving(answer(OK)) as server, pool() as p:
        with pytest.raises(ValueError):
            await p.request("POST", server.url, b"", {"X-A": "1\r\nX-B: 2"}, headers_within=1)
        assert server.requests == [] and p.in_use() == 0


CASES = [f for name, f in sorted(globals().items()) if name.startswith("test_")]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__[5:] for c in CASES])
def test_on_uvloop(case: Callable[[], Awaitable[None]]) -> None:
    """Every case again on uvloop, which pdproxy serves on (its transports differ)."""
    uvloop.run(case())
