"""pdproxy.upstream.http1 against engines that answer what no well-behaved engine would (issue 19,
item 1): interim 1xx, statuses out of range, heads past their caps, trailers, bytes after
the answer, bodies past the cap, huge chunk sizes, content codings, repeated headers, the
per-host wake-up and stale idle connections. Scripted servers on loopback, as in
tests/integration/test_http1.py; every case runs on asyncio and on uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import inspect
import socket
import zlib
from collections.abc import Awaitable, Callable

import pytest
import uvloop

from pdproxy.cli.main import parse_config
from pdproxy.upstream import http1
from pdproxy.upstream.http1.connection import MAX_FIELDS, MAX_HEAD, MAX_LINE
from tests.integration.test_http1 import CHUNKED_HEAD, OK, answer, chunk, pool, post, serving

Writer = asyncio.StreamWriter
Reader = asyncio.StreamReader


def head(status: bytes, *fields: bytes) -> bytes:
    return b"HTTP/1.1 " + status + b"\r\n" + b"".join(f + b"\r\n" for f in fields) + b"\r\n"


def whole(body: bytes, *fields: bytes) -> bytes:
    return head(b"200 OK", b"content-length: %d" % len(body), *fields) + body


async def read_one(p: http1.Pool, url: str, **kw: float | None) -> tuple[int, bytes]:
    response = await post(p, url, **kw)
    try:
        data = await response.read_all(1.0)
    except BaseException:
        response.close()
        raise
    response.release()
    return response.status, data


# --- interim 1xx ---


@pytest.mark.parametrize(
    "interim", [b"100 Continue", b"102 Processing", b"103 Early Hints", b"150 X"]
)
async def test_interim_answers_are_skipped_for_the_final_one(interim: bytes) -> None:
    async def script(reader: Reader, writer: Writer) -> None:
        writer.write(head(interim, b"link: </a>; rel=preload"))
        await writer.drain()
        await asyncio.sleep(0.05)  # the final answer comes later, as vLLM's would
        writer.write(whole(b'{"mine":1}'))
        await writer.drain()

    async with serving(script) as server, pool() as p:
        for _ in range(2):
            assert await read_one(p, server.url) == (200, b'{"mine":1}')
        assert server.connections == 1  # pooled, at the final answer's end


async def test_the_header_timeout_still_runs_while_interim_answers_come() -> None:
    async def script(reader: Reader, writer: Writer) -> None:
        for _ in range(20):
            writer.write(head(b"102 Processing"))
            await writer.drain()
            await asyncio.sleep(0.02)

    async with serving(script) as server, pool() as p:
        with pytest.raises(http1.ReadTimeout):
            await post(p, server.url, headers_within=0.1)
        assert p.in_use() == 0


async def test_endless_interim_answers_are_capped() -> None:
    async def script(reader: Reader, writer: Writer) -> None:
        writer.write(head(b"103 Early Hints") * (MAX_HEAD // 20))
        await writer.drain()

    async with serving(script) as server, pool() as p:
        with pytest.raises(http1.MalformedResponse):
            await post(p, server.url)


@pytest.mark.parametrize(
    "data",
    [
        head(b"101 Switching Protocols") + OK,
        head(b"101 Switching Protocols", b"connection: upgrade", b"upgrade: h2c") + OK,
        head(b"103 Early Hints", b"content-length: 3") + b"abc" + OK,
        head(b"100 Continue", b"transfer-encoding: chunked") + b"0\r\n\r\n" + OK,
    ],
    ids=["101", "101-upgrade", "1xx-with-length", "1xx-chunked"],
)
async def test_interim_answers_that_cannot_be_one_are_malformed(data: bytes) -> None:
    async with serving(answer(data)) as server, pool() as p:
        with pytest.raises(http1.MalformedResponse):
            await post(p, server.url)
        assert p.in_use() == 0


@pytest.mark.parametrize("status", [b"000", b"099", b"600", b"999"])
async def test_status_outside_100_599_is_malformed(status: bytes) -> None:
    data = head(status + b" X", b"content-length: 2") + b"{}"
    async with serving(answer(data)) as server, pool() as p:
        with pytest.raises(http1.MalformedResponse, match="not an HTTP status"):
            await post(p, server.url, headers_within=1.0)


@pytest.mark.parametrize("status", [b"204 No Content", b"304 Not Modified"])
async def test_bodyless_status_answering_a_post_is_malformed(status: bytes) -> None:
    async with serving(answer(head(status))) as server, pool() as p:
        with pytest.raises(http1.MalformedResponse, match="POST"):
            await post(p, server.url)
        response = await p.request("GET", server.url, b"", {}, headers_within=1.0)
        assert response.status == int(status[:3])  # a GET may be answered so
        assert await response.read_all(1.0) == b""
        response.release()


# --- heads past their caps ---


@pytest.mark.parametrize(
    "fields",
    [
        [b"x-big: " + b"a" * (1024 * 1024)],  # a 1 MiB line
        [b"x-long: " + b"a" * MAX_LINE],  # one byte past the line cap
        [b"x-%d: 1" % i for i in range(MAX_FIELDS + 1)],
        [b"x-%d: 1" % i for i in range(200_000)],
        [b"x-%d: %s" % (i, b"v" * 1000) for i in range(MAX_HEAD // 1000 + 1)],
    ],
    ids=["1MiB-line", "line-cap+1", "fields-cap+1", "200k-fields", "head-cap+1"],
)
async def test_heads_past_their_caps_are_malformed(fields: list[bytes]) -> None:
    data = head(b"200 OK", *fields, b"content-length: 2") + b"{}"

    async def script(reader: Reader, writer: Writer) -> None:
        writer.write(data)
        with contextlib.suppress(ConnectionError):
            await writer.drain()

    async with serving(script) as server, pool() as p:
        with pytest.raises(http1.MalformedResponse):
            await post(p, server.url)
        assert p.in_use() == 0


async def test_heads_at_their_caps_are_read() -> None:
    fields = [b"x-%d: 1" % i for i in range(MAX_FIELDS - 2)]
    fields.append(b"x-long: " + b"a" * (MAX_LINE - len(b"x-long: ") - 2))
    data = head(b"200 OK", *fields, b"content-length: 2") + b"{}"
    async with serving(answer(data)) as server, pool() as p:
        assert await read_one(p, server.url) == (200, b"{}")


async def test_an_endless_header_is_refused_after_the_cap_and_the_connection_closed() -> None:
    sent = 0

    async def script(reader: Reader, writer: Writer) -> None:
        nonlocal sent
        writer.write(b"HTTP/1.1 200 OK\r\nx-endless: ")
        with contextlib.suppress(ConnectionError):
            for _ in range(10_000):  # at most 640 MiB, if nobody stopped it
                writer.write(b"a" * 65536)
                sent += 65536
                await writer.drain()

    async with serving(script) as server, pool() as p:
        with pytest.raises(http1.MalformedResponse, match="head over"):
            await post(p, server.url, headers_within=5.0)
    assert sent < 64 * 1024 * 1024  # stopped long before: the connection was closed


# --- trailers and bytes after the answer ---


async def test_trailers_never_reach_the_next_answer() -> None:
    answers = [
        CHUNKED_HEAD + chunk(b"first") + b"0\r\nx-trailer: leak\r\nset-cookie: t=1\r\n\r\n",
        whole(b"second", b"x-own: 1"),
    ]

    async def script(reader: Reader, writer: Writer) -> None:
        writer.write(answers.pop(0))
        await writer.drain()

    async with serving(script) as server, pool() as p:
        first = await post(p, server.url)
        assert await first.read_all(1.0) == b"first"
        first.release()
        second = await post(p, server.url)
        assert await second.read_all(1.0) == b"second"
        assert set(second.headers) == {"content-length", "x-own"}
        second.release()
        assert server.connections == 1


async def test_endless_trailers_are_refused() -> None:
    async def script(reader: Reader, writer: Writer) -> None:
        writer.write(CHUNKED_HEAD + chunk(b"data: x\n\n") + b"0\r\nx-endless: ")
        with contextlib.suppress(ConnectionError):
            for _ in range(1000):
                writer.write(b"a" * 65536)
                await writer.drain()

    async with serving(script) as server, pool() as p:
        response = await post(p, server.url)
        with pytest.raises(http1.MalformedResponse):
            await response.read_all(5.0)
        response.close()


@pytest.mark.parametrize("extra", [b"X", b"HTTP/1.1 2", b"HTTP/1.1 200 OK\r\n"])
async def test_bytes_after_the_answer_keep_it_but_close_the_connection(extra: bytes) -> None:
    async with serving(answer(whole(b"{}") + extra)) as server, pool() as p:
        for _ in range(2):
            assert await read_one(p, server.url) == (200, b"{}")
        assert server.connections == 2


async def test_an_answer_sent_after_the_answer_is_never_read_as_the_next() -> None:
    async def script(reader: Reader, writer: Writer) -> None:
        writer.write(whole(b"mine"))
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(whole(b"stale"))  # while the connection idles in the pool
        await writer.drain()

    async with serving(script) as server, pool() as p:
        assert await read_one(p, server.url) == (200, b"mine")
        await asyncio.sleep(0.1)
        assert await read_one(p, server.url) == (200, b"mine")
        assert server.connections == 2


@pytest.mark.parametrize("hangup", [False, True], ids=["bytes", "eof"])
async def test_an_idle_connection_is_looked_at_before_reuse(hangup: bool) -> None:
    """What arrived on an idle connection that the loop has not read yet (the engine wrote
    or hung up just now) is seen by polling its socket: it is closed, never used."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    loop = asyncio.get_running_loop()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/v1/completions"
    accepted: list[socket.socket] = []

    async def engine() -> None:
        while True:
            conn, _ = await loop.sock_accept(listener)
            accepted.append(conn)
            await loop.sock_recv(conn, 65536)
            await loop.sock_sendall(conn, OK)

    task = asyncio.create_task(engine())
    try:
        async with pool() as p:
            assert await read_one(p, url) == (200, b"{}")
            if hangup:  # no await between this and the next request: the loop cannot see it
                accepted[0].shutdown(socket.SHUT_WR)
            else:
                accepted[0].send(whole(b"stale"))
            assert await read_one(p, url) == (200, b"{}")
            assert len(accepted) == 2
    finally:
        task.cancel()
        listener.close()
        for conn in accepted:
            conn.close()


# --- bodies, chunk sizes and codings ---


async def test_a_body_past_the_cap_is_refused() -> None:
    async with serving(answer(whole(b"x" * 1001))) as server, pool(max_body=1000) as p:
        response = await post(p, server.url)
        with pytest.raises(http1.ResponseTooLarge):  # by its length, before any is read
            await response.read_all(1.0)
        response.close()
    stream = CHUNKED_HEAD + chunk(b"x" * 600) + chunk(b"x" * 600) + b"0\r\n\r\n"
    async with serving(answer(stream)) as server, pool(max_body=1000) as p:
        response = await post(p, server.url)
        with pytest.raises(http1.ResponseTooLarge):  # as it comes
            await response.read_all(1.0)
        response.close()
    async with serving(answer(whole(b"x" * 1000))) as server, pool(max_body=1000) as p:
        assert await read_one(p, server.url) == (200, b"x" * 1000)


async def test_the_largest_chunk_size_meets_the_body_cap() -> None:
    async def script(reader: Reader, writer: Writer) -> None:
        writer.write(CHUNKED_HEAD + b"ffffffffffffffff\r\n")
        with contextlib.suppress(ConnectionError):
            for _ in range(100):
                writer.write(b"y" * 65536)
                await writer.drain()

    async with serving(script) as server, pool(max_body=1 << 20) as p:
        with pytest.raises(http1.MalformedResponse, match="body cap"):  # at its size line
            response = await post(p, server.url)
            await response.read_all(1.0)
    overflow = CHUNKED_HEAD + b"10000000000000000\r\nabc"  # 17 hex digits
    async with serving(answer(overflow)) as server, pool() as p:
        response = await post(p, server.url)
        with pytest.raises(http1.MalformedResponse):
            await response.read_all(1.0)
        response.close()


@pytest.mark.parametrize(
    "cut", [len(CHUNKED_HEAD) - 1, len(CHUNKED_HEAD) + 3], ids=["head", "size"]
)
async def test_a_chunk_size_over_the_cap_is_malformed_before_its_bytes(cut: int) -> None:
    """Issue 29: the sizes are read before httptools takes the bytes, whichever read splits
    the head's end or the size line; a streamed body hands on the chunks before it, and
    not one byte after it."""
    before = chunk(b"fine")
    data = head(b"103 Early Hints") + CHUNKED_HEAD + before + b"%x\r\n" % ((1 << 20) + 1)
    cut += len(head(b"103 Early Hints")) + (len(before) if cut > len(CHUNKED_HEAD) else 0)

    async def script(reader: Reader, writer: Writer) -> None:
        for piece in (data[:cut], data[cut:], b"after" * 1000):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.05)

    async with serving(script) as server, pool(max_body=1 << 20) as p:
        response = await post(p, server.url)
        assert await response.read_chunk(1.0) == b"fine"
        with pytest.raises(http1.MalformedResponse, match="body cap"):
            await response.read_chunk(1.0)
        response.close()


@pytest.mark.parametrize(
    ("coding", "encode"),
    [
        (b"gzip", gzip.compress),
        (b"x-gzip", gzip.compress),
        (b"deflate", zlib.compress),
        (b"identity", lambda data: data),
    ],
)
async def test_a_coded_body_is_decoded(coding: bytes, encode: Callable[[bytes], bytes]) -> None:
    body = b'{"text":"%s"}' % (b"abc" * 1000)
    data = whole(encode(body), b"content-encoding: " + coding)
    async with serving(answer(data)) as server, pool() as p:
        assert await read_one(p, server.url) == (200, body)
        assert await read_one(p, server.url) == (200, body)
        assert server.connections == 1


async def test_a_coded_stream_is_decoded_chunk_by_chunk_and_never_pushed() -> None:
    compressor = zlib.compressobj(wbits=16 + zlib.MAX_WBITS)
    pieces = [
        compressor.compress(b"data: %d\n\n" % i) + compressor.flush(zlib.Z_SYNC_FLUSH)
        for i in range(3)
    ]
    pieces.append(compressor.flush())
    data = head(b"200 OK", b"transfer-encoding: chunked", b"content-encoding: gzip")
    data += b"".join(chunk(piece) for piece in pieces) + b"0\r\n\r\n"
    pushed: list[bytes] = []
    async with serving(answer(data)) as server, pool() as p:
        response = await post(p, server.url)
        response.push_to(lambda data: pushed.append(data) is None)
        assert await response.read_all(1.0) == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"
        response.release()
        assert pushed == []


async def test_a_zip_bomb_fails_at_the_cap_a_piece_at_a_time() -> None:
    bomb = gzip.compress(b"\0" * (16 * 1024 * 1024))  # 16 KiB that inflate to 16 MiB
    data = whole(bomb, b"content-encoding: gzip")
    async with serving(answer(data)) as server, pool(max_body=1 << 20) as p:
        response = await post(p, server.url)
        with pytest.raises(http1.ResponseTooLarge):
            await response.read_all(1.0)
        response.close()


@pytest.mark.parametrize(
    "fields",
    [
        [b"content-encoding: br"],
        [b"content-encoding: gzip, gzip"],
        [b"content-encoding: gzip"],  # but the body is not gzip
        [b"transfer-encoding: gzip, chunked"],
    ],
    ids=["br", "stacked", "corrupt", "transfer-coding"],
)
async def test_codings_pdproxy_cannot_read_are_malformed(fields: list[bytes]) -> None:
    data = head(b"200 OK", *fields, b"content-length: 7") + b"plain{}"
    if b"chunked" in fields[0]:
        data = head(b"200 OK", *fields) + chunk(b"plain{}") + b"0\r\n\r\n"
    async with serving(answer(data)) as server, pool() as p:
        with pytest.raises(http1.MalformedResponse):
            response = await post(p, server.url)
            try:
                await response.read_all(1.0)
            finally:
                response.close()


async def test_an_empty_coded_body_is_empty() -> None:
    data = head(b"204 No Content", b"content-encoding: gzip")
    async with serving(answer(data)) as server, pool() as p:
        response = await p.request("GET", server.url, b"", {}, headers_within=1.0)
        assert await response.read_all(1.0) == b""
        response.release()


async def test_a_cut_gzip_body_is_malformed() -> None:
    cut = gzip.compress(b"x" * 10_000)[:-8]
    async with serving(answer(whole(cut, b"content-encoding: gzip"))) as server, pool() as p:
        response = await post(p, server.url)
        with pytest.raises(http1.MalformedResponse):
            await response.read_all(1.0)
        response.close()


def test_the_body_cap_is_a_flag() -> None:
    argv = ["--prefill", "a:1", "--decode", "c:3"]
    assert parse_config(argv, {}).pool.max_response_body_bytes == 256 * 1024 * 1024
    config = parse_config([*argv, "--max-response-body-bytes", "1000"], {})
    assert config.pool.max_response_body_bytes == 1000
    env = {"PDPROXY_MAX_RESPONSE_BODY_BYTES": "2000"}
    assert parse_config(argv, env).pool.max_response_body_bytes == 2000
    with pytest.raises(SystemExit):
        parse_config([*argv, "--max-response-body-bytes", "0"], {})


# --- repeated headers ---


async def test_repeated_headers_are_kept() -> None:
    fields = [b"x-a: 1", b"set-cookie: a=1", b"X-A: 2", b"set-cookie: b=2", b"content-type: a/b"]
    async with serving(answer(whole(b"{}", *fields))) as server, pool() as p:
        response = await post(p, server.url)
        headers = response.headers
        assert headers.get("x-a") == "1, 2" and headers.get_all("x-a") == ["1", "2"]
        assert headers.get("set-cookie") == "a=1"
        assert headers.get_all("set-cookie") == ["a=1", "b=2"]
        assert headers["content-type"] == "a/b" and "content-length" in headers
        assert [name for name, _ in headers.items()].count("x-a") == 2
        await response.read_all(1.0)
        response.release()


# --- the per-host wake-up ---


async def test_a_freed_slot_wakes_a_host_below_its_cap_not_one_still_at_it() -> None:
    """A (its host at its cap) waits first, C second; B's slot is freed. C must be woken
    (before the fix A was, re-queued, and the wake-up was lost: C timed out)."""
    gate = asyncio.Event()

    async def held(reader: Reader, writer: Writer) -> None:
        await gate.wait()
        writer.write(OK)
        await writer.drain()

    async with (
        serving(held) as a,
        serving(answer(OK)) as b,
        serving(answer(OK)) as c,
        pool(limit=2, limit_per_host=1) as p,
    ):
        a1 = asyncio.create_task(post(p, a.url, headers_within=5.0))
        b1 = await post(p, b.url)
        await asyncio.sleep(0.02)  # a1 holds A's slot, b1 B's: both caps reached
        a2 = asyncio.create_task(post(p, a.url, headers_within=5.0))
        await asyncio.sleep(0.02)
        c1 = asyncio.create_task(post(p, c.url, headers_within=1.0))
        await asyncio.sleep(0.02)
        assert not a1.done() and not a2.done() and not c1.done()
        await b1.read_all(1.0)
        b1.close()  # frees a slot overall; A is still at its own cap
        response = await asyncio.wait_for(c1, 1.0)
        assert await response.read_all(1.0) == b"{}"
        response.release()
        assert not a2.done()
        gate.set()
        for task in (a1, a2):
            response = await asyncio.wait_for(task, 2.0)
            await response.read_all(1.0)
            response.release()
        assert p.in_use() == 0


def _calls() -> list[tuple[str, Callable[..., Awaitable[None]], dict[str, object]]]:
    """Every case of this module with each of its parameters (one parametrize mark each)."""
    calls = []
    for name, case in sorted(globals().items()):
        if not name.startswith("test_") or not inspect.iscoroutinefunction(case):
            continue
        marks = [m for m in getattr(case, "pytestmark", []) if m.name == "parametrize"]
        if not marks:
            calls.append((name[5:], case, {}))
            continue
        names, values = marks[0].args
        names = [n.strip() for n in names.split(",")] if isinstance(names, str) else names
        ids = marks[0].kwargs.get("ids") or [str(i) for i in range(len(values))]
        for id_, value in zip(ids, values, strict=True):
            args = value if len(names) > 1 else (value,)
            calls.append((f"{name[5:]}[{id_}]", case, dict(zip(names, args, strict=True))))
    return calls


CALLS = _calls()


@pytest.mark.parametrize(("case", "kwargs"), [c[1:] for c in CALLS], ids=[c[0] for c in CALLS])
def test_on_uvloop(case: Callable[..., Awaitable[None]], kwargs: dict[str, object]) -> None:
    """Every case again on uvloop, which pdproxy serves on (its transports differ)."""
    uvloop.run(case(**kwargs))
