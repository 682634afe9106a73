"""Hostile clients on raw sockets against a real pdproxy process (issue 19, rows 2 and 6;
pdproxy.runtime.listener): endless request heads, idle and slowloris connections under a small
open-file limit, the connection cap, stalled bodies.

pdproxy runs as ``python -m pdproxy`` (its RSS, open files and RLIMIT_NOFILE are its own)
in front of a sim prefill and decode on this loop. Each case asserts the fixed behaviour,
that ``/health`` answered 200 with p99 under 100 ms while the attack ran (probed from a
thread, on a new connection each time, as an orchestrator does), that pdproxy's memory
stayed bounded, and that every client got its own answer and nothing else. Timeouts are
short (--client-header-timeout-secs 2, --client-body-timeout-secs 1) so each case takes a
few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import os
import resource
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import aiohttp
import orjson
import pytest

from engines.ports import free_port
from engines.sim import SimConfig, running_sim
from pdproxy.runtime.listener import OVER_CAP_WAITING
from pdproxy.wire.local_tokenizer import MAX_PROMPT_CHARS
from tests import latency
from tests.hostile.control_health import running_control
from tests.sim_tokenizer import write_model_dir

HOST = "127.0.0.1"
MODEL = "sim-model"
HEADER_TIMEOUT = 2.0
BODY_TIMEOUT = 1.0
FLAGS = [
    "--client-header-timeout-secs",
    str(HEADER_TIMEOUT),
    "--client-body-timeout-secs",
    str(BODY_TIMEOUT),
    "--health-check-interval-secs",
    "0.2",
]
MiB = 1024 * 1024
RSS_GROWTH = 48 * MiB  # the issue measured 65 MB -> 2.5 GB from one connection in 18 s
P99 = 0.1


# pdproxy and its engines


@dataclass
class Proxy:
    proc: subprocess.Popen[bytes]
    port: int
    prefill: object
    decode: object
    log_path: str

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def rss(self) -> int:
        return _rss(self.proc.pid)

    def open_files(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@contextlib.asynccontextmanager
async def pdproxy(
    tmp_path,
    *flags: str,
    nofile: int | None = None,
    decode_tps: float = 0.0,
    max_model_len: int = 4096,
) -> AsyncIterator[Proxy]:
    """pdproxy in its own process (``nofile``: its RLIMIT_NOFILE) before a 1P1D sim fleet."""
    engine = SimConfig(model=MODEL, max_model_len=max_model_len)
    async with (
        running_sim(dataclasses.replace(engine, role="prefill")) as p,
        running_sim(dataclasses.replace(engine, role="decode", decode_tps=decode_tps)) as d,
    ):
        port = free_port()
        args = [sys.executable, "-m", "pdproxy", "--host", HOST, "--port", str(port)]
        args += ["--prefill", p.url, "--decode", d.url, *FLAGS, *flags]
        log_path = str(tmp_path / "pdproxy.log")
        with _process(args, log_path, nofile) as proc:
            proxy = Proxy(proc, port, p, d, log_path)
            await _until_ready(proxy)
            yield proxy


@contextlib.contextmanager
def _process(args: list[str], log_path: str, nofile: int | None) -> Iterator[subprocess.Popen]:
    def limit_files() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=limit_files,
        )
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def _until_ready(proxy: Proxy) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(300):
            with contextlib.suppress(aiohttp.ClientError):
                async with s.get(proxy.url + "/ready") as r:
                    if r.status == 200:
                        return
            assert proxy.proc.poll() is None, proxy.log()
            await asyncio.sleep(0.05)
    raise AssertionError("pdproxy did not become ready:\n" + proxy.log())


# /health, probed from a process of its own while an attack runs


@dataclass
class HealthProbe:
    """/health latencies (tests.hostile.probe_health) and pdproxy's peaks of memory and
    open files (sampled from a thread: no timing there)."""

    proxy: Proxy
    latencies: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    control: list[float] = field(default_factory=list)  # the control's, probe by probe
    max_rss: int = 0
    max_open_files: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def sample(self) -> None:
        while not self.stop.wait(0.02):
            self.max_rss = max(self.max_rss, self.proxy.rss())
            self.max_open_files = max(self.max_open_files, self.proxy.open_files())

    def check(self) -> None:
        assert not self.failures, self.failures[:3]
        assert len(self.latencies) >= 30, len(self.latencies)
        p99 = latency.p99(self.latencies)
        control = latency.p99(self.control) if self.control else 0.0
        # P99 above what the control took at the same moments: a freeze of pdproxy's loop
        # still shows whole, a loaded machine's scheduling delay (the control has it too) not
        assert p99 < P99 + control, (
            f"/health p99 {p99 * 1000:.1f} ms over {len(self.latencies)} probes"
            f" (the control's p99: {control * 1000:.1f} ms)"
        )


@contextlib.contextmanager
def health_probed(proxy: Proxy) -> Iterator[HealthProbe]:
    """Probe ``/health`` for the block's length; then assert it stayed fast and 200."""
    probe = HealthProbe(proxy)
    with running_control() as control_port:
        args = [
            sys.executable,
            "-m",
            "tests.hostile.probe_health",
            str(proxy.port),
            str(control_port),
        ]
        prober = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        sampler = threading.Thread(target=probe.sample, daemon=True)
        sampler.start()
        try:
            yield probe
        finally:
            probe.stop.set()
            sampler.join(10)
            out, _ = prober.communicate(timeout=30)  # closes its stdin: it stops and reports
    report = json.loads(out)
    probe.latencies, probe.failures = report["latencies"], report["failures"]
    probe.control = report["control"]
    probe.check()


def test_the_health_bound_allows_the_machines_delay_and_still_sees_a_freeze():
    """The bound moves with what the control took at the same moments, never more."""
    quick, loaded = [0.004] * 99 + [0.02], [0.05] * 100
    HealthProbe(None, latencies=[0.12] * 100, control=loaded).check()  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="p99"):
        HealthProbe(None, latencies=[0.12] * 100, control=quick).check()  # type: ignore[arg-type]
    frozen = [0.004] * 90 + [1.0] * 10  # a loop frozen for a second, ten probes long
    with pytest.raises(AssertionError, match="p99"):
        HealthProbe(None, latencies=frozen, control=loaded).check()  # type: ignore[arg-type]


# clients


def _prompt(i: int) -> str:
    return f"client {i} asks its own question, number {i}"


async def completions(proxy: Proxy, ids: range) -> dict[int, tuple[int, str]]:
    """One completion per id, concurrently, each on a connection of its own."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as s:

        async def one(i: int) -> tuple[int, str]:
            body = {"model": MODEL, "prompt": _prompt(i), "max_tokens": 6}
            async with s.post(proxy.url + "/v1/completions", json=body) as r:
                raw = await r.read()
            if r.status != 200:
                return r.status, raw.decode(errors="replace")
            return r.status, orjson.loads(raw)["choices"][0]["text"]

        answers = await asyncio.gather(*(one(i) for i in ids))
    return dict(zip(ids, answers, strict=True))


async def own_answers(proxy: Proxy, ids: range, reference: dict[int, tuple[int, str]]) -> None:
    """Every client got 200 and its own prompt's text (the sim's text follows the prompt)."""
    answers = await completions(proxy, ids)
    assert answers == reference


def _answer(raw: bytes) -> tuple[int, dict[bytes, bytes], dict]:
    """(status, headers, JSON body) of exactly one HTTP/1.1 response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert raw.count(b"HTTP/1.1 ") == 1, raw[:300]
    lines = head.split(b"\r\n")
    headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
    assert int(headers[b"content-length"]) == len(body), raw[:300]
    return int(lines[0].split()[1]), headers, orjson.loads(body)


def _refusal(raw: bytes, status: int, error_type: str) -> dict[bytes, bytes]:
    code, headers, body = _answer(raw)
    assert code == status and body["error"]["type"] == error_type, raw[:300]
    assert headers[b"connection"] == b"close" and headers[b"content-type"] == b"application/json"
    return headers


async def flood_head(port: int, prefix: bytes, filler: bytes, seconds: float) -> bytes:
    """Send ``prefix``, then ``filler`` over and over until pdproxy answers and closes (or
    ``seconds`` pass); what it answered."""
    reader, writer = await asyncio.open_connection(HOST, port)
    answer = asyncio.create_task(_read_to_end(reader))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    writer.write(prefix)
    with contextlib.suppress(ConnectionError, TimeoutError):
        while not answer.done() and loop.time() < deadline:
            writer.write(filler)
            await asyncio.wait_for(writer.drain(), 0.2)
    try:
        return await asyncio.wait_for(answer, 5)
    finally:
        writer.close()


async def _read_to_end(reader: asyncio.StreamReader) -> bytes:
    """Everything until EOF; a reset after the answer keeps what came before it."""
    chunks = []
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(65536):
            chunks.append(chunk)
    return b"".join(chunks)


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes | None:
    """What pdproxy sent before closing, or None if it kept the connection open."""
    try:
        return await asyncio.wait_for(_read_to_end(reader), seconds)
    except TimeoutError:
        return None


# cases


@pytest.mark.parametrize(
    ("prefix", "filler"),
    [
        (b"GET /health HTTP/1.1\r\nHost: p\r\nX-Long: ", b"a" * 16384),
        (b"GET /health HTTP/1.1\r\nHost: p\r\n", b"X-Small: b\r\n" * 1365),
    ],
    ids=["endless header value", "endless small headers"],
)
async def test_an_endless_head_gets_431_at_the_bound_and_costs_nothing(tmp_path, prefix, filler):
    async with pdproxy(tmp_path) as proxy:
        reference = await completions(proxy, range(8))
        quiet_rss = proxy.rss()
        with health_probed(proxy) as probe:

            async def attacker() -> list[bytes]:
                answers = []
                deadline = time.monotonic() + 3
                while time.monotonic() < deadline:
                    answers.append(await flood_head(proxy.port, prefix, filler, 5))
                return answers

            attacks = asyncio.gather(*(attacker() for _ in range(2)))
            await own_answers(proxy, range(8), reference)
            answers = [a for batch in await attacks for a in batch]
        assert len(answers) >= 8
        for raw in answers:  # each its own 431, once, and the connection closed
            _refusal(raw, 431, "RequestHeaderFieldsTooLargeError")
        assert probe.max_rss - quiet_rss < RSS_GROWTH, (quiet_rss, probe.max_rss)
        # nothing of the attacks reached an engine: only the clients' own legs
        assert len(proxy.decode.generation_requests()) == 16


async def test_header_count_and_size_bounds_are_exact(tmp_path):
    flags = ["--max-request-headers", "20", "--max-request-head-bytes", "4096"]
    async with pdproxy(tmp_path, *flags) as proxy:

        async def get(extra: bytes) -> bytes:
            reader, writer = await asyncio.open_connection(HOST, proxy.port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: p\r\nConnection: close\r\n" + extra)
            writer.write(b"\r\n")
            try:
                return await asyncio.wait_for(_read_to_end(reader), 5)
            finally:
                writer.close()

        fields = b"".join(b"X-%d: v\r\n" % i for i in range(18))  # 20 with Host, Connection
        assert (await get(fields)).startswith(b"HTTP/1.1 200")
        _refusal(await get(fields + b"X-One-More: v\r\n"), 431, "RequestHeaderFieldsTooLargeError")
        assert (await get(b"X-Big: " + b"v" * 3900 + b"\r\n")).startswith(b"HTTP/1.1 200")
        refused = await get(b"X-Big: " + b"v" * 4200 + b"\r\n")
        _refusal(refused, 431, "RequestHeaderFieldsTooLargeError")
        # a small head before a body far larger than the bound is served (the bound is the
        # head's, even when the head and the body come in one read)
        body = orjson.dumps({"model": MODEL, "prompt": "x" * 200_000, "max_tokens": 2})
        connector = aiohttp.TCPConnector(force_close=True)
        async with (
            aiohttp.ClientSession(connector=connector) as s,
            s.post(proxy.url + "/v1/completions", data=body, headers=_json()) as r,
        ):
            assert r.status == 200, await r.text()


def _json() -> dict[str, str]:
    return {"Content-Type": "application/json"}


async def test_idle_and_slowloris_connections_cannot_starve_a_small_fd_limit(tmp_path):
    """The issue's case: 1,000 idle connections against 1,024 fds made 25/25 requests 503
    and the decode unhealthy (its probes had no fd) while /health said 200."""
    async with pdproxy(tmp_path, nofile=512) as proxy:  # the connection cap: 256
        reference = await completions(proxy, range(25))
        with health_probed(proxy) as probe:
            idle = []
            for _ in range(10):
                idle += await asyncio.gather(
                    *(asyncio.open_connection(HOST, proxy.port) for _ in range(100))
                )
                await asyncio.sleep(0.05)
            slow = [await asyncio.open_connection(HOST, proxy.port) for _ in range(50)]
            dribbling = _dribble([w for _, w in slow], b"GET /health HTTP/1.1\r\n")
            dribble = asyncio.create_task(dribbling)
            await own_answers(proxy, range(25), reference)
            # every idle connection is closed by the header deadline, if not evicted before
            idle_ends = await asyncio.gather(
                *(_closed_within(r, HEADER_TIMEOUT + 2) for r, _ in idle)
            )
            slow_ends = await asyncio.gather(
                *(_closed_within(r, HEADER_TIMEOUT + 2) for r, _ in slow)
            )
            dribble.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await dribble
        for writer in [w for _, w in idle + slow]:
            writer.close()
        assert all(end == b"" for end in idle_ends)  # closed, silently: nothing was asked
        for end in slow_ends:  # closed; a 408 unless evicted as idle before the deadline
            assert end is not None
            if end:
                _refusal(end, 408, "RequestTimeoutError")
        assert sum(1 for end in slow_ends if end) >= len(slow) // 2
        assert probe.max_open_files < 512
        status = orjson.loads(await _get(proxy, "/status"))
        assert [i["health"] for i in status["instances"]] == ["healthy", "healthy"]
        assert all(i["routable"] and i["consecutive_failures"] == 0 for i in status["instances"])
        assert "unhealthy" not in proxy.log()


async def _dribble(writers: list[asyncio.StreamWriter], head: bytes) -> None:
    """Slowloris: a request head, one byte at a time, every 0.3 s, never finished."""
    for i in range(1000):
        for w in writers:
            if not w.is_closing():
                w.write(head[i % len(head) : i % len(head) + 1])
        await asyncio.sleep(0.3)


async def _get(proxy: Proxy, path: str) -> bytes:
    async with aiohttp.ClientSession() as s, s.get(proxy.url + path) as r:
        assert r.status == 200
        return await r.read()


async def test_past_the_cap_the_oldest_idle_connection_is_closed_first(tmp_path):
    async with pdproxy(tmp_path, "--max-client-connections", "8") as proxy:
        reference = await completions(proxy, range(1))
        idle = []
        for _ in range(8):
            idle.append(await asyncio.open_connection(HOST, proxy.port))
            await asyncio.sleep(0.02)  # each younger than the one before
        await own_answers(proxy, range(1), reference)  # a 9th connection: room is made
        ends = await asyncio.gather(*(_closed_within(r, 0.3) for r, _ in idle))
        closed = [end is not None for end in ends]
        assert closed[0], closed
        assert closed == sorted(closed, reverse=True), closed  # the oldest ones, in order
        assert not all(closed), closed
        for _, w in idle:
            w.close()


async def test_past_the_cap_a_stalled_body_makes_room_when_none_is_idle(tmp_path):
    """Stalled bodies hold their connections busy until --client-body-timeout-secs; at the
    cap, one silent for a tick (0.5 s here) is ended with 408 to make room."""
    flags = ["--max-client-connections", "4", "--client-body-timeout-secs", "30"]
    async with pdproxy(tmp_path, *flags) as proxy:
        reference = await completions(proxy, range(1))
        stalled = [await _start_body(proxy, b'{"model": "sim-') for _ in range(4)]
        await asyncio.sleep(1.5)
        await own_answers(proxy, range(1), reference)
        ends = await asyncio.gather(*(_closed_within(r, 0.3) for r, _ in stalled))
        for _, writer in stalled:
            writer.close()
        answered = [end for end in ends if end is not None]
        assert len(answered) == 1, ends  # as many as room was needed for
        _refusal(answered[0], 408, "RequestTimeoutError")


async def test_with_every_connection_busy_a_new_one_gets_503_but_probes_are_answered(tmp_path):
    async with pdproxy(tmp_path, "--max-client-connections", "8", decode_tps=20) as proxy:
        reference = await asyncio.gather(*(_stream(proxy, i) for i in range(8)))
        streams = [asyncio.create_task(_stream(proxy, i)) for i in range(8)]
        for _ in range(200):
            if len(proxy.decode.generation_requests()) == 16:
                break
            await asyncio.sleep(0.02)
        with health_probed(proxy):  # past the cap: /health is still answered, 200
            refused = []
            for _ in range(5):
                reader, writer = await asyncio.open_connection(HOST, proxy.port)
                body = orjson.dumps({"model": MODEL, "prompt": "one too many", "max_tokens": 2})
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nHost: p\r\nContent-Type: application/json"
                    b"\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
                )
                refused.append(await asyncio.wait_for(_read_to_end(reader), 5))
                writer.close()
            # silent newcomers: 32 may wait for their request, the others get 503 at once
            silent = [await asyncio.open_connection(HOST, proxy.port) for _ in range(40)]
            early = await asyncio.gather(*(_closed_within(r, 0.5) for r, _ in silent))
            for _, writer in silent:
                writer.close()
            texts = await asyncio.gather(*streams)
        for raw in refused + [raw for raw in early if raw is not None]:
            headers = _refusal(raw, 503, "ServiceUnavailableError")
            assert headers[b"retry-after"] == b"1"
        assert len([raw for raw in early if raw is not None]) >= 40 - OVER_CAP_WAITING
        # the streams were never disturbed: each its own tokens, to the end
        assert texts == reference
        assert len(proxy.decode.generation_requests()) == 16  # 8 references + 8 busy


async def _stream(proxy: Proxy, i: int) -> str:
    body = {"model": MODEL, "prompt": _prompt(i), "max_tokens": 40, "stream": True}
    connector = aiohttp.TCPConnector(force_close=True)
    async with (
        aiohttp.ClientSession(connector=connector) as s,
        s.post(proxy.url + "/v1/completions", json=body) as r,
    ):
        raw = await r.read()
    assert r.status == 200, raw
    events = [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]" and all(b'"error"' not in e for e in events), raw[-300:]
    return "".join(orjson.loads(e)["choices"][0]["text"] for e in events[:-1])


async def test_stalled_bodies_get_408_and_a_slow_but_steady_one_is_served(tmp_path):
    async with pdproxy(tmp_path) as proxy:
        quiet_rss = proxy.rss()
        with health_probed(proxy) as probe:
            stalled = [await _start_body(proxy, b'{"model": "sim-') for _ in range(50)]
            steady = asyncio.create_task(_trickled_completion(proxy))
            ends = await asyncio.gather(
                *(_closed_within(r, 2 * BODY_TIMEOUT + 2) for r, _ in stalled)
            )
            assert await steady == 200
        for _, writer in stalled:
            writer.close()
        for end in ends:
            assert end is not None
            _refusal(end, 408, "RequestTimeoutError")
        assert probe.max_rss - quiet_rss < RSS_GROWTH
        assert len(proxy.decode.generation_requests()) == 1  # the steady one only


async def _start_body(proxy: Proxy, part: bytes):
    reader, writer = await asyncio.open_connection(HOST, proxy.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n" + part
    )
    return reader, writer


async def _trickled_completion(proxy: Proxy) -> int:
    """A body sent in pieces 0.4 s apart (under the 1 s body timeout), 3 s in all."""
    body = orjson.dumps({"model": MODEL, "prompt": "slow but steady", "max_tokens": 2})
    reader, writer = await asyncio.open_connection(HOST, proxy.port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    step = -(-len(body) // 8)
    for start in range(0, len(body), step):
        await asyncio.sleep(0.4)
        writer.write(body[start : start + step])
    raw = await asyncio.wait_for(_read_to_end(reader), 10)
    writer.close()
    status, _, answer = _answer(raw)
    assert answer["choices"][0]["text"], answer
    return status


async def test_every_worker_serves_through_the_bounds(tmp_path):
    """--workers: each serving process builds its listener with the same function, limits
    and protocol (pdproxy.runtime.server.uvicorn_config); the kernel spreads connections over them
    (20 connections all on one of two workers: one chance in half a million)."""
    flags = ["--workers", "2", "--max-request-head-bytes", "4096"]
    async with pdproxy(tmp_path, *flags) as proxy:
        pids: set[int] = set()
        for _ in range(200):  # until both workers listen
            pids.add(orjson.loads(await _get(proxy, "/status"))["worker"]["pid"])
            if len(pids) == 2:
                break
            await asyncio.sleep(0.05)
        assert len(pids) == 2
        for _ in range(20):
            refused = await flood_head(
                proxy.port, b"GET /status HTTP/1.1\r\nHost: p\r\nX-Big: ", b"v" * 1024, 5
            )
            _refusal(refused, 431, "RequestHeaderFieldsTooLargeError")


async def test_huge_prompts_tokenized_by_pdproxy_never_slow_health(tmp_path):
    """--tokenizer (pdproxy tokenizes text for kv-events): clients send prompts just under
    the 1 MiB the local tokenizer takes, several at once. They are encoded on threads that
    release the GIL, so /health stays fast; every client is answered, and each prompt was
    tokenized exactly (pdproxy_prompt_tokens_total), not skipped."""
    words = [f"w{i:03d}" + "x" * 96 for i in range(512)]  # 100 characters a token
    folder = write_model_dir(tmp_path / "tokenizer", [" ".join(words)])
    text = " ".join(words[i % 512] for i in range(MAX_PROMPT_CHARS // 100))
    text = text[: MAX_PROMPT_CHARS - 8]  # about 10,400 tokens
    kv_events = ("--prefill-policy", "kv-events", "--decode-policy", "kv-events")
    flags = (*kv_events, "--tokenizer", str(folder))
    async with pdproxy(tmp_path, *flags, max_model_len=16384) as proxy:
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as s:

            async def one(i: int) -> int:
                prompt = f"w{i} {text}"[:MAX_PROMPT_CHARS]
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
                data = io.BytesIO(orjson.dumps(body))  # aiohttp warns of a large bytes body
                headers = {"Content-Type": "application/json"}
                async with s.post(proxy.url + "/v1/completions", data=data, headers=headers) as r:
                    await r.read()
                    return r.status

            with health_probed(proxy):
                await asyncio.sleep(0.3)  # probes before the prompts, too
                for _ in range(2):
                    assert await asyncio.gather(*(one(i) for i in range(4))) == [200] * 4
            async with s.get(proxy.url + "/metrics") as r:
                metrics = await r.text()
    assert 'pdproxy_prompt_tokens_total{outcome="exact"} 8.0' in metrics, proxy.log()[-2000:]


async def test_a_chat_of_many_empty_messages_is_never_rendered_on_the_loop(tmp_path):
    """Issue 29: the size that sent a chat template's render to a thread counted only the
    messages' content, and the 1 MiB cap was checked after rendering: 900,000 empty
    messages rendered on the loop and stalled /health 12 s. Every message, part and tool
    now counts, and a body past the cap is not rendered at all."""
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    folder = write_model_dir(
        tmp_path / "tokenizer", ["user: hi"], config={"chat_template": template}
    )
    kv_events = ("--prefill-policy", "kv-events", "--decode-policy", "kv-events")
    async with pdproxy(tmp_path, *kv_events, "--tokenizer", str(folder)) as proxy:
        body = {
            "model": MODEL,
            # 17,000 messages of no content: the old render took about 0.2 s of loop each;
            # reading the body and the scheduler's features about 30 ms (every large body
            # pays those); with their names they count past the 1 MiB that renders
            "messages": [{"role": "user", "content": "", "name": "n" * 48}] * 17_000,
            "max_tokens": 1,
        }
        data = orjson.dumps(body)
        async with aiohttp.ClientSession() as s:
            with health_probed(proxy):
                await asyncio.sleep(0.3)
                for _ in range(4):
                    async with s.post(
                        proxy.url + "/v1/chat/completions",
                        data=io.BytesIO(data),
                        headers={"Content-Type": "application/json"},
                    ) as r:
                        await r.read()
                        assert r.status < 500
                await asyncio.sleep(0.5)  # probes enough for a p99 however fast it went
            async with s.get(proxy.url + "/metrics") as r:
                metrics = await r.text()
    assert 'pdproxy_prompt_tokens_total{outcome="unsupported"} 4.0' in metrics
