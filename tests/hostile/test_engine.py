"""A hostile engine in front of a real pdproxy (issue 19, rows 1, 3, 9, 10, 11 and the
defects read in ``pdproxy/upstream/http1``): each case scripts the engine's bytes, drives attacking
clients and bystanders (whose requests share the engine's pooled connections) for a bounded
time, and asserts what each client got: the attackers the right OpenAI-shaped error (or
their own answer), every bystander its own answer, ``/health`` p99 under 100 ms all along,
and, for the huge heads and bodies, memory bounded (tracemalloc's peak, in process)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import tracemalloc
import zlib
from collections.abc import Iterator

import aiohttp
import orjson
import pytest

from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.config.upstream import PoolLimits
from tests.hostile.hostile_engine import (
    MODEL,
    Answer,
    Exchange,
    HealthProbe,
    Writer,
    ask,
    attacked,
    chunk,
    completion,
    drive,
    endless,
    fleet,
    good_decode,
    good_prefill,
    head,
    own_answer,
    own_text,
    sse_events,
    whole,
)

MiB = 1024 * 1024
BAD_GATEWAY = "BadGatewayError"


def _rss_peak() -> int | None:
    """This process's peak resident memory (bytes) since the last reset, or None when the
    OS does not tell (Linux's /proc only)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@contextlib.contextmanager
def memory_bounded(limit: int = 64 * MiB) -> Iterator[None]:
    """This process (pdproxy, the engine and the clients alike) grows its resident memory by
    less than ``limit`` over the block: its peak RSS, reset first (/proc/self/clear_refs),
    which costs nothing while the attack runs; tracemalloc's peak where /proc has none."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # resets VmHWM to the current RSS
        start = _rss_peak()
    except OSError:
        start = None
    if start is None:
        tracemalloc.start()
    try:
        yield
        peak = tracemalloc.get_traced_memory()[1] if start is None else _rss_peak() - start
    finally:
        if start is None:
            tracemalloc.stop()
    assert peak < limit, f"memory grew by {peak / MiB:.1f} MiB"


def answering(data: bytes):
    async def script(exchange: Exchange, writer: Writer) -> None:
        writer.write(data)
        await writer.drain()

    return script


async def refused(attack, *, status: int = 502, error_type: str | None = BAD_GATEWAY, **kw):
    """pdproxy in front of a decode that attacks the attackers' requests: each attacker
    gets the error, every bystander its own answer (``drive``'s checks)."""
    async with fleet(decode=attacked(attack, good_decode), **kw.pop("proxy", {})) as f:
        attacks, _ = await drive(f, **kw)
    for answer in attacks:
        assert_error(answer, status, error_type)


def assert_error(answer: Answer, status: int, error_type: str | None) -> None:
    """An OpenAI-shaped JSON error with ``status`` (never a 200 or an empty body)."""
    assert answer.status == status, (answer.status, answer.body[:300])
    error = orjson.loads(answer.body)["error"]
    assert {"message", "type", "code"} <= set(error), error
    assert error["code"] == status
    if error_type is not None:
        assert error["type"] == error_type, error


# --- row 1: interim 1xx ---


def early(interim: bytes, then):
    async def script(exchange: Exchange, writer: Writer) -> None:
        writer.write(head(interim, b"link: </style.css>; rel=preload"))
        await writer.drain()
        await asyncio.sleep(0.05)  # the real answer comes later, as an engine's would
        await then(exchange, writer)

    return script


async def test_client_b_never_gets_client_a_answer_after_an_early_hint() -> None:
    """The issue's scenario: the prefill sends 103, then A's answer; B, next on the same
    pooled connection, must get its own (before: A got 103 and B got A's KV params)."""
    async with fleet(prefill=early(b"103 Early Hints", good_prefill)) as f:
        async with HealthProbe(f.proxy.url) as health, aiohttp.ClientSession() as session:
            a = await ask(session, f, "client A")
            b = await ask(session, f, "client B")
        health.assert_fast(at_least=5)
        a.assert_own()
        b.assert_own()
        assert f.prefills[0].connections == 1  # one pooled connection carried both


@pytest.mark.parametrize("interim", [b"100 Continue", b"103 Early Hints"])
@pytest.mark.parametrize("leg", ["prefill", "decode"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_interim_answers_are_skipped(interim: bytes, leg: str, stream: bool) -> None:
    good = good_prefill if leg == "prefill" else good_decode
    async with fleet(**{leg: attacked(early(interim, good), good)}) as f:
        attacks, _ = await drive(f, stream=stream)
    for answer in attacks:
        answer.assert_own()


async def test_a_101_is_refused() -> None:
    upgrade = head(b"101 Switching Protocols", b"connection: upgrade", b"upgrade: websocket")
    await refused(answering(upgrade + b"\x81\x05hello"))


# --- row 3: response heads ---


def huge_line() -> bytes:
    return whole(completion("x"), b"x-big: " + b"a" * MiB)


def many_fields() -> bytes:
    return whole(completion("x"), *(b"x-%d: 1" % i for i in range(200_000)))


@pytest.mark.parametrize("answer", [huge_line, many_fields], ids=["1MiB-line", "200k-fields"])
async def test_huge_heads_are_refused(answer) -> None:
    data = answer()
    with memory_bounded():
        await refused(answering(data))


async def test_an_endless_header_is_refused_and_costs_nothing() -> None:
    async def attack(exchange: Exchange, writer: Writer) -> None:
        await endless(writer, b"HTTP/1.1 200 OK\r\nx-endless: ", b"a" * 65536)

    with memory_bounded():
        await refused(attack)


# --- rows 9 and 10: statuses that are none ---


@pytest.mark.parametrize("status", [b"000", b"600", b"999"])
async def test_a_status_outside_100_599_is_a_502(status: bytes) -> None:
    """000 no longer waits for the read timeout (a 504), 600-999 no longer drop the client
    with 0 bytes."""
    await refused(answering(whole(completion("x"), status=status + b" Odd")))


# --- row 11: bodies ---

CAP = PoolLimits(max_response_body_bytes=4 * MiB)


@pytest.mark.parametrize("framing", ["length", "chunked"])
async def test_a_body_past_the_cap_is_a_502(framing: str) -> None:
    piece = b"x" * 65536

    async def attack(exchange: Exchange, writer: Writer) -> None:
        if framing == "length":
            start = head(b"200 OK", b"content-length: %d" % (512 * MiB))
            await endless(writer, start, piece, most=512 * MiB)
        else:
            start = head(b"200 OK", b"transfer-encoding: chunked")
            await endless(writer, start, chunk(piece), most=512 * MiB)

    with memory_bounded():
        await refused(attack, proxy={"pool": CAP})


async def test_the_largest_chunk_size_meets_the_cap() -> None:
    async def attack(exchange: Exchange, writer: Writer) -> None:
        start = head(b"200 OK", b"transfer-encoding: chunked") + b"ffffffffffffffff\r\n"
        await endless(writer, start, b"y" * 65536, most=512 * MiB)

    with memory_bounded():
        await refused(attack, proxy={"pool": CAP})


@pytest.mark.parametrize("size", [b"ffffffffffffffff", b"%x" % (4 * MiB + 1)])
async def test_a_chunk_size_over_the_cap_ends_a_stream_before_its_bytes(size: bytes) -> None:
    """Issue 29: httptools takes any chunk size up to 2**64 - 1, and the bytes after such a
    size line were relayed to the streaming client as content until the read deadline (the
    stream did not end within 5 s). The size is read before the parser takes the bytes: the
    leg is malformed, the stream ends with the error event at once, none of them relayed."""

    async def attack(exchange: Exchange, writer: Writer) -> None:
        writer.write(SSE_HEAD + FIRST_EVENT)  # the client's stream has begun
        await writer.drain()
        await asyncio.sleep(0.05)
        start = size + b"\r\n" + b"data: LEAKED\n\n"
        await endless(writer, start, b"LEAKED" * 10000, most=64 * MiB)

    async with fleet(decode=attacked(attack, good_decode), pool=CAP) as f:
        attacks, _ = await drive(f, stream=True, seconds=0.5, attackers=1)
    for answer in attacks:
        _ended_with_error(answer)
        assert b"LEAKED" not in answer.body, answer.body[:300]


@pytest.mark.parametrize("coding", [b"gzip", b"deflate"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_coded_answer_is_decoded(coding: bytes, stream: bool) -> None:
    """Never served compressed as plain JSON: the client gets the decoded answer."""

    async def coded(exchange: Exchange, writer: Writer) -> None:
        text = own_text(exchange)
        plain = sse_events(text) if stream else completion(text)
        data = gzip.compress(plain) if coding == b"gzip" else zlib.compress(plain)
        kind = b"text/event-stream" if stream else b"application/json"
        fields = (b"content-type: " + kind, b"content-encoding: " + coding)
        writer.write(head(b"200 OK", *fields, b"transfer-encoding: chunked"))
        writer.write(chunk(data[:10]) + chunk(data[10:]) + b"0\r\n\r\n")  # split mid-header
        await writer.drain()

    async with fleet(decode=attacked(coded, good_decode)) as f:
        attacks, _ = await drive(f, stream=stream)
    for answer in attacks:
        answer.assert_own()
        assert "content-encoding" not in {k.lower() for k in answer.headers}


async def test_a_zip_bomb_is_a_502() -> None:
    bomb = gzip.compress(b"\0" * (64 * MiB))  # 64 KiB that inflate to 64 MiB
    data = whole(bomb, b"content-encoding: gzip")
    with memory_bounded():
        await refused(answering(data), proxy={"pool": CAP})


async def test_an_unknown_coding_is_a_502() -> None:
    await refused(answering(whole(b"\x1b\x00\x00", b"content-encoding: br")))


@pytest.mark.parametrize("status", [b"204 No Content", b"304 Not Modified"])
async def test_a_bodyless_answer_to_a_post_is_a_502(status: bytes) -> None:
    await refused(answering(head(status)))


# --- read in code: trailers, repeated headers, the per-host wake-up ---


async def test_trailers_never_reach_another_answer() -> None:
    """Attackers' streams end with trailers; bystanders' answers (no Content-Type of their
    own) come next on the same connections and must not carry them."""
    trailers = b"content-type: text/x-leaked\r\nx-secret: attacker\r\n"

    async def attack(exchange: Exchange, writer: Writer) -> None:
        writer.write(own_answer(exchange)[:-2] + trailers + b"\r\n")
        await writer.drain()

    async def bare(exchange: Exchange, writer: Writer) -> None:
        body = completion(f"{exchange.prompt}|{exchange.tag}")
        writer.write(head(b"200 OK", b"content-length: %d" % len(body)) + body)
        await writer.drain()

    async with fleet(decode=attacked(attack, bare)) as f:
        attacks, others = await drive(f, stream=True, bystander_stream=False)
    for answer in attacks:
        answer.assert_own()
    for answer in others:
        assert answer.headers["Content-Type"] == "application/json"
        assert "x-secret" not in {k.lower() for k in answer.headers}
    assert f.decodes[0].connections <= 8  # the connections were pooled and shared


async def test_repeated_headers_are_kept() -> None:
    """Both ``metadata`` fields of an embeddings answer reach the client (before: the last)."""

    async def script(exchange: Exchange, writer: Writer) -> None:
        body = orjson.dumps({"object": "list", "data": [], "model": MODEL})
        writer.write(whole(body, b"metadata: first", b"metadata: second"))
        await writer.drain()

    async with fleet(decode=script) as f, aiohttp.ClientSession() as session:
        payload = {"model": MODEL, "input": "x"}
        async with session.post(f.proxy.url + "/v1/embeddings", json=payload) as r:
            assert r.status == 200
            assert r.headers.getall("metadata") in (["first, second"], ["first", "second"])


async def test_a_freed_slot_is_never_lost_to_a_host_at_its_cap() -> None:
    """--max-connections-per-host 1, three decodes, each busy; a request waits for each
    (D1's first). D3's slot is freed: D3's waiter must get it (before: D1's was woken,
    found D1 still full, re-queued, and D3's waited until its timeout)."""
    gates: dict[str, asyncio.Event] = {}

    async def held(exchange: Exchange, writer: Writer) -> None:
        await gates.setdefault(exchange.prompt, asyncio.Event()).wait()
        writer.write(whole(completion(exchange.prompt + "|")))
        await writer.drain()

    proxy = {
        "pool": PoolLimits(max_connections_per_host=1),
        "scheduling": SchedulingConfig(
            prefill_policy="round-robin", decode_policy="round-robin", pd_threshold_tokens=10**6
        ),
    }
    async with (
        fleet(decode=[held, held, held], **proxy) as f,
        HealthProbe(f.proxy.url) as health,
        aiohttp.ClientSession() as s,
    ):
        pool = f.proxy.state.client._legs
        first = [asyncio.create_task(ask(s, f, f"busy {i}")) for i in range(3)]
        await _until(lambda: all(d.exchanges for d in f.decodes))
        waiting = []
        for i in range(3):  # D1's, D2's, D3's, queued in that order
            waiting.append(asyncio.create_task(ask(s, f, f"waits {i}")))
            await _until(lambda n=i + 1: sum(len(q) for q in pool._waiting.values()) == n)
        gates.setdefault("waits 2", asyncio.Event()).set()
        gates.setdefault("busy 2", asyncio.Event()).set()  # D3's slot is freed
        third = await asyncio.wait_for(waiting[2], 3.0)
        assert third.status == 200 and third.text == "waits 2|"
        assert not any(t.done() for t in first[:2] + waiting[:2])  # the others still wait
        for event in ("busy 0", "busy 1", "waits 0", "waits 1"):
            gates.setdefault(event, asyncio.Event()).set()
        for task in first + waiting:
            assert (await asyncio.wait_for(task, 5.0)).status == 200
    health.assert_fast(at_least=5)


async def _until(condition, seconds: float = 3.0) -> None:
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


# --- issue 29: a decode stream's size, when the request may migrate ---

SSE_HEAD = head(b"200 OK", b"content-type: text/event-stream", b"transfer-encoding: chunked")
FIRST_EVENT = chunk(b'data: {"id":"c","choices":[{"index":0,"text":"a"}]}\n\n')


def _ended_with_error(answer: Answer) -> None:
    assert answer.status == 200, (answer.status, answer.body[:300])
    assert b'"error"' in answer.body[-4096:], answer.body[-300:]


async def test_an_endless_event_is_cut_at_the_event_cap_in_linear_time() -> None:
    """Before, a stream that may migrate joined its kept bytes again on every chunk once
    256 KiB lacked an event end: an unterminated 128 MiB event cost 28.6 s of CPU and a
    22.7 s /health stall. It is now folded only when a chunk may end an event, and past
    --max-stream-event-bytes the stream ends with the error event."""

    async def attack(exchange: Exchange, writer: Writer) -> None:
        await endless(writer, SSE_HEAD + FIRST_EVENT, chunk(b"x" * 65536), most=128 * MiB)

    pool = PoolLimits(max_stream_event_bytes=1 * MiB)
    with memory_bounded():  # this process's: the attacker's answers are kept, ~1 MiB each
        async with fleet(decode=attacked(attack, good_decode), pool=pool) as f:
            attacks, _ = await drive(f, stream=True, seconds=0.5, attackers=1)
    for answer in attacks:
        _ended_with_error(answer)
        assert len(answer.body) < 2 * MiB


async def test_an_endless_stream_of_valid_events_is_cut_at_the_stream_cap() -> None:
    event = chunk(b'data: {"id":"c","choices":[{"index":0,"text":"' + b"y" * 4000 + b'"}]}\n\n')

    async def attack(exchange: Exchange, writer: Writer) -> None:
        await endless(writer, SSE_HEAD, event, most=256 * MiB)

    pool = PoolLimits(max_stream_bytes=1 * MiB)
    with memory_bounded():
        async with fleet(decode=attacked(attack, good_decode), pool=pool) as f:
            attacks, _ = await drive(f, stream=True, seconds=0.5, attackers=1)
    for answer in attacks:
        _ended_with_error(answer)
        assert len(answer.body) < 2 * MiB
