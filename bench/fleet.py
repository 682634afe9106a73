"""A P/D fleet of sim engines behind one pdproxy, for the fault benchmark and the soak test.

Every server is its own process. A sim keeps its HTTP and KV ports, so it can be killed
(SIGKILL) and started again on the same address; run-time faults go through its
``/sim/faults`` API. Also here: the closed-loop client that counts a request as succeeded
only when its answer is whole, and the readers of pdproxy's ``/status``, ``/metrics`` and
``/proc`` figures.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import aiohttp
import orjson

from bench.procs import process, wait_healthy
from engines.ports import free_ports

T = TypeVar("T")
R = TypeVar("R")
StreamMode = Literal["none", "mixed", "all"]
_JSON = {"Content-Type": "application/json"}
_PROMPT = "The quick brown fox jumps over the lazy dog " * 4


def host_port(url: str) -> str:
    """``http://127.0.0.1:8100/`` → ``127.0.0.1:8100``, to compare URLs written differently."""
    return url.split("://", 1)[-1].rstrip("/")


# Processes


@dataclass
class Sim:
    """One sim engine process on fixed ports; ``kill`` and ``start`` may alternate."""

    name: str
    role: str
    port: int
    kv_port: int
    decode_tps: float
    logdir: str
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    _stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            *(sys.executable, "-m", "engines.sim", "--role", self.role, "--connector", "nixl"),
            *("--port", str(self.port), "--kv-port", str(self.kv_port)),
            *("--decode-tps", str(self.decode_tps), "--log-level", "warning"),
        ]

    def start(self) -> None:
        self.starts += 1
        log = f"{self.logdir}/{self.name}.{self.starts}.log"
        self.proc = self._stack.enter_context(process(self.command(), log))

    def kill(self) -> None:
        """SIGKILL (no clean shutdown), then reap the process so its pid is never reused."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.stop()

    def stop(self) -> None:
        self._stack.close()
        self.proc = None


@dataclass
class Fleet:
    prefills: list[Sim]
    decodes: list[Sim]
    proxy_url: str
    proxy_pid: int

    @property
    def sims(self) -> list[Sim]:
        return [*self.prefills, *self.decodes]


def proxy_command(port: int, fleet_sims: list[Sim], extra: list[str]) -> list[str]:
    prefill = [s.url for s in fleet_sims if s.role == "prefill"]
    decode = [s.url for s in fleet_sims if s.role == "decode"]
    return [
        *(sys.executable, "-m", "pdproxy", "--host", "127.0.0.1", "--port", str(port)),
        *("--prefill", *prefill, "--decode", *decode, "--log-level", "warning"),
        *extra,
    ]


@contextlib.asynccontextmanager
async def fleet(
    prefills: int, decodes: int, decode_tps: float, proxy_extra: list[str], logdir: str
) -> AsyncIterator[Fleet]:
    """Start the sims and pdproxy, wait until all answer /health; stop them all on exit."""
    ports = free_ports(2 * (prefills + decodes) + 1)
    roles = ["prefill"] * prefills + ["decode"] * decodes
    names = [f"prefill-{i}" for i in range(prefills)] + [f"decode-{i}" for i in range(decodes)]
    sims = [
        Sim(name, role, ports[2 * i], ports[2 * i + 1], decode_tps, logdir)
        for i, (name, role) in enumerate(zip(names, roles, strict=True))
    ]
    proxy_port = ports[-1]
    with contextlib.ExitStack() as stack:
        for sim in sims:
            stack.callback(sim.stop)
            sim.start()
        command = proxy_command(proxy_port, sims, proxy_extra)
        proxy = stack.enter_context(process(command, f"{logdir}/pdproxy.log"))
        proxy_url = f"http://127.0.0.1:{proxy_port}"
        for url in [*(s.url for s in sims), proxy_url]:
            await wait_healthy(url)
        yield Fleet(sims[:prefills], sims[prefills:], proxy_url, proxy.pid)


@contextlib.asynccontextmanager
async def in_background(owner: T, loop: Coroutine[Any, Any, None]) -> AsyncIterator[T]:
    """Run ``loop`` while the block runs; cancel it (and wait for it) afterwards."""
    task = asyncio.create_task(loop)
    try:
        yield owner
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def run_with_logdir(
    prefix: str, logdir: str | None, main: Callable[[str], Coroutine[Any, Any, R]]
) -> R:
    """Run ``main(logdir)`` on uvloop, in ``logdir`` or a temporary folder removed afterwards."""
    import uvloop

    with contextlib.ExitStack() as stack:
        folder = logdir or stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix))
        os.makedirs(folder, exist_ok=True)
        return uvloop.run(main(folder))


def stop_on_sigterm() -> None:
    """Make SIGTERM cancel the current task as Ctrl-C does, so every process gets stopped."""
    task = asyncio.current_task()
    if task is not None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)


class StallWatch:
    """The longest the benchmark's own event loop went without running a 50 ms ticker.

    A large figure (a busy or paused machine) means latencies above it are not pdproxy's.
    """

    def __init__(self, tick: float = 0.05) -> None:
        self.tick = tick
        self.worst = 0.0

    def running(self) -> contextlib.AbstractAsyncContextManager[StallWatch]:
        return in_background(self, self._loop())

    async def _loop(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(self.tick)
            self.worst = max(self.worst, time.monotonic() - before - self.tick)


# Sim control


async def set_faults(session: aiohttp.ClientSession, sim: Sim, faults: dict[str, Any]) -> bool:
    """Replace the sim's faults; False when it rejects them (a knob this sim does not know)."""
    async with session.post(sim.url + "/sim/faults", json=faults) as r:
        await r.read()
        return r.status == 200


async def clear_faults(session: aiohttp.ClientSession, sim: Sim) -> None:
    """Best effort: a sim that is down or refusing connections has no faults to clear."""
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
        async with session.delete(sim.url + "/sim/faults") as r:
            await r.read()


async def get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as r:
        r.raise_for_status()
        return orjson.loads(await r.read())


async def answers_health(session: aiohttp.ClientSession, url: str) -> bool:
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
        async with session.get(url + "/health") as r:
            return r.status == 200
    return False


def control_session() -> aiohttp.ClientSession:
    """A session for control calls, apart from the load's, with short timeouts."""
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5))


# Load


@dataclass(frozen=True)
class LoadSpec:
    max_tokens: int = 12
    stream: StreamMode = "mixed"
    timeout_s: float = 30.0
    model: str = "sim-model"


@dataclass(frozen=True)
class Outcome:
    started: float  # epoch seconds, comparable with the sim's records
    latency: float  # seconds
    kind: str  # "ok", or why the request failed: "http_503", "timeout", "incomplete_stream", ...

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    @property
    def ended(self) -> float:
        return self.started + self.latency


def payload(spec: LoadSpec, stream: bool) -> bytes:
    return orjson.dumps(
        {"model": spec.model, "prompt": _PROMPT, "max_tokens": spec.max_tokens, "stream": stream}
    )


def stream_verdict(body: bytes) -> str:
    """A stream succeeded if every event is JSON without ``error`` and it ends with [DONE]."""
    events = [line[6:].strip() for line in body.split(b"\n") if line.startswith(b"data: ")]
    if not events or events[-1] != b"[DONE]":
        return "incomplete_stream"
    for event in events[:-1]:
        try:
            chunk = orjson.loads(event)
        except orjson.JSONDecodeError:
            return "bad_body"
        if isinstance(chunk, dict) and "error" in chunk:
            return "error_event"
    return "ok"


def whole_verdict(body: bytes) -> str:
    try:
        answer = orjson.loads(body)
    except orjson.JSONDecodeError:
        return "bad_body"
    choices = answer.get("choices") if isinstance(answer, dict) else None
    return "ok" if isinstance(choices, list) and choices else "bad_body"


async def attempt(
    session: aiohttp.ClientSession, url: str, body: bytes, stream: bool, timeout: float
) -> str:
    """One request; its verdict ("ok" or a failure kind). Never raises for network trouble."""
    # ceil_threshold: aiohttp rounds longer timeouts up to a whole second unless told not to
    limit = aiohttp.ClientTimeout(total=timeout, ceil_threshold=timeout + 1)
    try:
        async with session.post(url, data=body, headers=_JSON, timeout=limit) as r:
            answer = await r.read()
            status = r.status
    except asyncio.TimeoutError:
        return "timeout"
    except aiohttp.ClientConnectorError:
        return "connect_error"
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError):
        return "disconnected"
    except (aiohttp.ClientError, OSError):
        return "client_error"
    if status != 200:
        return f"http_{status}"
    return stream_verdict(answer) if stream else whole_verdict(answer)


class Load:
    """A closed loop: ``concurrency`` workers, each sending one request after another.

    ``outcomes`` grows while it runs, so a fault can be injected after the N-th answer.
    """

    def __init__(self, base_url: str, spec: LoadSpec) -> None:
        self.url = base_url + "/v1/completions"
        self.spec = spec
        self.outcomes: list[Outcome] = []
        self.finished = False
        self._answered = asyncio.Event()
        self._sent = 0
        self._bodies = {s: payload(spec, s) for s in (False, True)}

    def _stream(self, i: int) -> bool:
        return self.spec.stream == "all" or (self.spec.stream == "mixed" and i % 2 == 1)

    async def run(
        self, total: int, concurrency: int, stop: asyncio.Event | None = None
    ) -> list[Outcome]:
        connector = aiohttp.TCPConnector(limit=0)
        try:
            async with aiohttp.ClientSession(connector=connector) as session:
                workers = (self._worker(session, total, stop) for _ in range(concurrency))
                await asyncio.gather(*workers)
        finally:
            self.finished = True
            self._answered.set()
        return self.outcomes

    async def _worker(
        self, session: aiohttp.ClientSession, total: int, stop: asyncio.Event | None
    ) -> None:
        while self._sent < total and not (stop is not None and stop.is_set()):
            stream = self._stream(self._sent)
            self._sent += 1
            started, t0 = time.time(), time.perf_counter()
            kind = await attempt(
                session, self.url, self._bodies[stream], stream, self.spec.timeout_s
            )
            self.outcomes.append(Outcome(started, time.perf_counter() - t0, kind))
            self._answered.set()

    async def wait_for(self, answers: int) -> None:
        """Until ``answers`` requests have finished (or the load has ended)."""
        while len(self.outcomes) < answers and not self.finished:
            self._answered.clear()
            await self._answered.wait()


@dataclass(frozen=True)
class Summary:
    total: int
    ok: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    failures: dict[str, int]

    @property
    def success_pct(self) -> float:
        return 100.0 * self.ok / max(self.total, 1)


def percentile_ms(latencies: list[float], q: float) -> float:
    if not latencies:
        return float("nan")
    ordered = sorted(latencies)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(outcomes: list[Outcome]) -> Summary:
    """Latency percentiles are over every request, failed ones included."""
    latencies = [o.latency for o in outcomes]
    return Summary(
        total=len(outcomes),
        ok=sum(o.ok for o in outcomes),
        p50_ms=1000 * statistics.median(latencies) if latencies else float("nan"),
        p99_ms=percentile_ms(latencies, 0.99),
        max_ms=1000 * max(latencies, default=float("nan")),
        failures=dict(Counter(o.kind for o in outcomes if not o.ok).most_common()),
    )


# pdproxy observations


def metric_sum(text: str, name: str) -> float | None:
    """Sum of a metric's samples over all labels; None if pdproxy does not export it."""
    if name not in text:
        return None
    total = 0.0
    for line in text.splitlines():
        rest = line[len(name) :]
        if line.startswith(name) and rest[:1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def retries_total(session: aiohttp.ClientSession, proxy_url: str) -> float | None:
    async with session.get(proxy_url + "/metrics") as r:
        return metric_sum(await r.text(), "pdproxy_retries_total")


@dataclass(frozen=True)
class ProcFigures:
    rss_kib: int
    fds: int


def proc_figures(pid: int) -> ProcFigures:
    """Resident memory (VmRSS) and open file descriptors of one process, from /proc."""
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return ProcFigures(rss, len(os.listdir(f"/proc/{pid}/fd")))


class ProxyWatch:
    """Polls pdproxy's /status and /metrics every ``interval`` s and notes when things change.

    ``changes`` holds ``(epoch, host:port, routable)`` whenever an instance's ``routable``
    flips (and its first sighting); it stays empty if /status has no ``instances`` yet.
    """

    def __init__(self, proxy_url: str, interval: float = 0.05) -> None:
        self.proxy_url = proxy_url
        self.interval = interval
        self.has_instances = False
        self.routable: dict[str, bool] = {}
        self.changes: list[tuple[float, str, bool]] = []
        self.retries: float | None = None
        self.retries_changed_at: float | None = None  # when the retry count last grew

    def running(self) -> contextlib.AbstractAsyncContextManager[ProxyWatch]:
        return in_background(self, self._loop())

    def first_change(self, url: str, routable: bool, after: float) -> float | None:
        key = host_port(url)
        return next(
            (t for t, k, r in self.changes if k == key and r is routable and t >= after), None
        )

    async def _loop(self) -> None:
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    await self.poll(session)
                await asyncio.sleep(self.interval)

    async def poll(self, session: aiohttp.ClientSession) -> None:
        status = await get_json(session, self.proxy_url + "/status")
        now = time.time()
        for instance in status.get("instances") or ():
            self.has_instances = True
            key, routable = host_port(str(instance.get("url"))), bool(instance.get("routable"))
            if self.routable.get(key) is not routable:
                self.changes.append((now, key, routable))
                self.routable[key] = routable
        retries = await retries_total(session, self.proxy_url)
        if retries is not None and self.retries is not None and retries > self.retries:
            self.retries_changed_at = time.time()
        self.retries = retries
