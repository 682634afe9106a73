"""A hostile engine: an asyncio server on 127.0.0.1 that answers each POST with exactly the
bytes its script writes (raw socket, no HTTP library in the way), and pdproxy in front of
such engines, with the tools every hostile case asserts with.

A script is ``async (exchange, writer)``; it writes whatever it likes (or nothing) and may
close the writer. ``good_prefill`` and ``good_decode`` answer as vLLM would, tagged so a
client can check the answer it got is its own: the prefill's ``kv_transfer_params`` carry
the prompt it read, and the decode answers ``"<its prompt>|<that tag>"``. GETs (pdproxy's
probes) are answered as a healthy engine would.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import aiohttp
import orjson

from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.resilience import HealthConfig, OutlierConfig, RetryConfig
from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.config.upstream import Timeouts
from pdproxy.runtime.server import settle_garbage_collector
from pdproxy.types import EngineAddress
from tests import latency
from tests.servers import RunningProxy, running_proxy

MODEL = "sim-model"
Writer = asyncio.StreamWriter


@dataclasses.dataclass
class Exchange:
    """One request the engine read."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> dict[str, Any]:
        return orjson.loads(self.body) if self.body else {}

    @property
    def prompt(self) -> str:
        return str(self.json.get("prompt", ""))

    @property
    def stream(self) -> bool:
        return bool(self.json.get("stream"))

    @property
    def tag(self) -> str:
        """What the prefill's ``kv_transfer_params`` said (a decode's request)."""
        params = self.json.get("kv_transfer_params") or {}
        return str(params.get("tag", ""))


Script = Callable[[Exchange, Writer], Awaitable[None]]


class HostileEngine:
    """Answers every POST with ``script``; records what it read (``exchanges``) and counts
    its connections."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.exchanges: list[Exchange] = []
        self.url = ""

    async def handle(self, reader: asyncio.StreamReader, writer: Writer) -> None:
        self.connections += 1
        try:
            while not writer.is_closing():
                exchange = await _read_request(reader)
                if exchange.method == "GET":
                    writer.write(_probe_answer(exchange.path))
                    continue
                self.exchanges.append(exchange)
                await self.script(exchange, writer)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()


async def _read_request(reader: asyncio.StreamReader) -> Exchange:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Exchange(method, path, headers, body)


def _probe_answer(path: str) -> bytes:
    if path == "/v1/models":
        return whole(orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}))
    return whole(b"") if path == "/health" else whole(b"", status=b"404 Not Found")


@contextlib.asynccontextmanager
async def hostile_engine(script: Script) -> AsyncIterator[HostileEngine]:
    engine = HostileEngine(script)
    server = await asyncio.start_server(engine.handle, "127.0.0.1", 0)
    engine.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield engine
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2)


# --- answers, as bytes ---


def head(status: bytes, *fields: bytes) -> bytes:
    return b"HTTP/1.1 " + status + b"\r\n" + b"".join(f + b"\r\n" for f in fields) + b"\r\n"


def whole(body: bytes, *fields: bytes, status: bytes = b"200 OK") -> bytes:
    fields = (b"content-type: application/json", *fields)
    return head(status, *fields, b"content-length: %d" % len(body)) + body


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def completion(text: str, **extra: Any) -> bytes:
    """A vLLM completions answer (non-streamed) whose text is ``text``."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    answer = {"id": "cmpl-hostile", "object": "text_completion", "created": 0, "model": MODEL}
    return orjson.dumps({**answer, "choices": [choice], "usage": usage, **extra})


def prefill_json(tag: str) -> bytes:
    """A prefill's answer, its ``kv_transfer_params`` tagged with the prompt it read."""
    params = {"remote_engine_id": "hostile-prefill", "remote_block_ids": [0], "tag": tag}
    return completion("", kv_transfer_params={**params, "remote_host": "127.0.0.1"})


def sse_events(text: str) -> bytes:
    """A vLLM completions stream's bytes for ``text``: two events, then ``[DONE]``."""
    event = {"id": "cmpl-hostile", "object": "text_completion", "model": MODEL}
    out = b""
    for piece in (text[: len(text) // 2], text[len(text) // 2 :]):
        payload = {**event, "choices": [{"index": 0, "text": piece, "finish_reason": None}]}
        out += b"data: " + orjson.dumps(payload) + b"\n\n"
    return out + b"data: [DONE]\n\n"


def sse(text: str, trailers: bytes = b"") -> bytes:
    """``sse_events`` as a chunked answer, an event a chunk, then ``trailers``."""
    out = head(b"200 OK", b"content-type: text/event-stream", b"transfer-encoding: chunked")
    for event in sse_events(text).split(b"\n\n")[:-1]:
        out += chunk(event + b"\n\n")
    return out + b"0\r\n" + trailers + b"\r\n"


def own_text(exchange: Exchange) -> str:
    return f"{exchange.prompt}|{exchange.tag}"


def own_answer(exchange: Exchange) -> bytes:
    """What ``good_decode`` answers ``exchange``."""
    text = own_text(exchange)
    return sse(text) if exchange.stream else whole(completion(text))


async def good_prefill(exchange: Exchange, writer: Writer) -> None:
    writer.write(whole(prefill_json(exchange.prompt)))
    await writer.drain()


async def good_decode(exchange: Exchange, writer: Writer) -> None:
    writer.write(own_answer(exchange))
    await writer.drain()


def attacked(attack: Script, good: Script) -> Script:
    """``attack`` for the prompts that start with "attack", ``good`` for the others (the
    bystanders, whose requests share the engine's pooled connections)."""

    async def script(exchange: Exchange, writer: Writer) -> None:
        chosen = attack if exchange.prompt.startswith("attack") else good
        await chosen(exchange, writer)

    return script


async def endless(writer: Writer, start: bytes, piece: bytes, most: int = 1 << 30) -> int:
    """Write ``start`` then ``piece`` again and again until the peer closes (at most
    ``most`` bytes: the attack stays bounded); the bytes written."""
    sent = 0
    with contextlib.suppress(ConnectionError):
        writer.write(start)
        while sent < most and not writer.is_closing():
            writer.write(piece)
            sent += len(piece)
            await writer.drain()
    return sent


# --- pdproxy in front ---


def quick() -> dict[str, Any]:
    """Short timeouts, no probes, no ejection (the hostile engine stays routable), one
    retry, round-robin: every case's pdproxy settings unless it overrides them."""
    return dict(
        timeouts=Timeouts(connect=1.0, read=5.0, prefill=5.0, decode_headers=5.0),
        # no health probes, load scrapes or /v1/models reads: only the legs reach the engine
        health=HealthConfig(interval=0, engine_metrics_interval=0, models_interval=0),
        outlier=OutlierConfig(consecutive_failures=0),
        retry=RetryConfig(max_retries=1, initial_backoff=0.01, max_backoff=0.05),
        scheduling=SchedulingConfig(prefill_policy="round-robin", decode_policy="round-robin"),
        access_log=False,
    )


@dataclasses.dataclass
class Fleet:
    proxy: RunningProxy
    prefills: list[HostileEngine]
    decodes: list[HostileEngine]


@contextlib.asynccontextmanager
async def fleet(
    prefill: Script | list[Script] = good_prefill,
    decode: Script | list[Script] = good_decode,
    **proxy: Any,
) -> AsyncIterator[Fleet]:
    """pdproxy (nixl, serial legs) in front of hostile engines, one per script."""
    prefills = prefill if isinstance(prefill, list) else [prefill]
    decodes = decode if isinstance(decode, list) else [decode]
    async with contextlib.AsyncExitStack() as stack:
        p = [await stack.enter_async_context(hostile_engine(s)) for s in prefills]
        d = [await stack.enter_async_context(hostile_engine(s)) for s in decodes]
        config = ProxyConfig(
            prefill=tuple(EngineAddress(url=e.url) for e in p),
            decode=tuple(EngineAddress(url=e.url) for e in d),
            kv_connector="nixl",
            **{**quick(), **proxy},
        )
        running = await stack.enter_async_context(running_proxy(config))
        stack.enter_context(_settled_garbage_collector())
        yield Fleet(running, p, d)


@contextlib.contextmanager
def _settled_garbage_collector() -> Iterator[None]:
    """The collector as pdproxy's server sets it once serving (start-up's objects frozen,
    young collections rarer), for the block: a collection walking this test process's
    whole heap (pytest's, every module's) paused the loop up to 300 ms."""
    thresholds = gc.get_threshold()
    settle_garbage_collector()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


# --- clients ---


@dataclasses.dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes
    prompt: str
    stream: bool

    @property
    def text(self) -> str:
        """The completion's text (a stream's pieces joined)."""
        if not self.stream:
            return str(orjson.loads(self.body)["choices"][0]["text"])
        events = [e[6:] for e in self.body.split(b"\n\n") if e.startswith(b"data: ")]
        assert events[-1] == b"[DONE]", self.body[-200:]
        return "".join(orjson.loads(e)["choices"][0]["text"] for e in events[:-1])

    def assert_own(self) -> None:
        """The answer is this client's own: 200, and the text its prompt twice (the
        decode's read of its prompt and of the prefill's tag)."""
        assert self.status == 200, (self.status, self.body[:300])
        assert self.text == f"{self.prompt}|{self.prompt}", (self.prompt, self.text)


async def ask(
    session: aiohttp.ClientSession, f: Fleet, prompt: str, stream: bool = False
) -> Answer:
    payload = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream}
    async with session.post(f.proxy.url + "/v1/completions", json=payload) as r:
        body = await r.read()
        return Answer(r.status, dict(r.headers), body, prompt, stream)


class HealthProbe:
    """``GET /health`` on pdproxy every few ms while an attack runs; ``assert_fast``.

    A probe's latency is its wall time but at most the CPU time this process spent while it
    was out (pdproxy's work, the engine's and the clients', all in this process): time the
    OS gave other processes on the shared cores is not pdproxy's (it showed as single
    100-350 ms probes with the process idle). The wall time is bounded too, loosely."""

    def __init__(self, url: str) -> None:
        self.url = url + "/health"
        self.samples: list[tuple[float, float]] = []  # (wall, cpu) seconds
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                wall, cpu = time.perf_counter(), time.process_time()
                async with session.get(self.url) as r:
                    await r.read()
                    assert r.status == 200
                self.samples.append((time.perf_counter() - wall, time.process_time() - cpu))
                await asyncio.sleep(0.005)

    async def __aenter__(self) -> HealthProbe:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        if self._task.done():
            self._task.result()  # a probe that failed
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def assert_fast(self, p99: float = 0.1, wall: float = 1.0, at_least: int = 20) -> None:
        assert len(self.samples) >= at_least, f"{len(self.samples)} /health probes"
        latencies = sorted(min(w, c) for w, c in self.samples)
        worst = latency.p99(latencies)  # not the maximum of fewer than 100 probes
        walls = sorted(w for w, _ in self.samples)
        slowest = ", ".join(f"{w * 1000:.0f}/{c * 1000:.0f}" for w, c in sorted(self.samples)[-3:])
        detail = (
            f"over {len(latencies)} probes (median {latencies[len(latencies) // 2] * 1000:.1f}"
            f" ms; slowest, wall/cpu: {slowest} ms)"
        )
        assert worst < p99, f"/health p99 {worst * 1000:.1f} ms {detail}"
        assert walls[-1] < wall, f"/health took {walls[-1] * 1000:.0f} ms {detail}"


async def drive(
    f: Fleet,
    *,
    seconds: float = 1.0,
    attackers: int = 2,
    bystanders: int = 2,
    stream: bool = False,
    bystander_stream: bool | None = None,
) -> tuple[list[Answer], list[Answer]]:
    """For ``seconds``, ``attackers`` clients ask "attack ..." prompts and ``bystanders``
    ask their own (streamed as ``stream`` unless ``bystander_stream`` says), each one
    request after another, ``/health`` sampled all along; returns (attacks, bystanders)
    once the last request ended, asserting the probe and that each bystander got its own."""
    attacks: list[Answer] = []
    others: list[Answer] = []

    async def client(session: aiohttp.ClientSession, name: str, into: list, stream: bool) -> None:
        for i in itertools.count():
            if time.monotonic() > until:
                return
            into.append(await ask(session, f, f"{name} {i}", stream))

    calm = stream if bystander_stream is None else bystander_stream
    async with aiohttp.ClientSession() as session:  # warm: first-use costs are no attack
        (await ask(session, f, "warm", stream=calm)).assert_own()
    async with HealthProbe(f.proxy.url) as health, aiohttp.ClientSession() as session:
        until = time.monotonic() + seconds
        clients = [client(session, f"attack {n}", attacks, stream) for n in range(attackers)]
        clients += [client(session, f"bystander {n}", others, calm) for n in range(bystanders)]
        await asyncio.wait_for(asyncio.gather(*clients), seconds + 30)
    health.assert_fast()
    assert attacks or not attackers
    for answer in others:
        answer.assert_own()
    return attacks, others
