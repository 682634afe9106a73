"""``make bench-workers``: what ``pdproxy --workers 1`` and ``--workers 2`` serve and cost, in
the same run, alternating, against instant engine stand-ins.

The engines answer at once (``bench/null_engine.py`` by default: canned answers on a raw
protocol, a tenth of a sim's CPU per request, and paced SSE streams; ``--engines sim``: sims
with every timing knob at 0, which on two cores cost more per request than the proxy does)
and the client is lean (``bench.lean_client``), so as much of the machine as possible is left
to the proxy. Each round of a variant starts a fresh proxy and runs two phases, each after a
warm-up: ``--connections`` closed-loop connections of short whole requests for ``--seconds``
(the kernel spreads them over the workers' sockets), then ``--streams`` closed-loop streams of
``--stream-tokens`` tokens at ``--tps`` tokens per second. It reads, from ``/proc``, the CPU
time of every pdproxy process (the supervisor and its workers), of the engines and of this
client around each phase, and the memory of the process tree (RSS and PSS, summed) during the
streams. A third variant in every round, the client straight to the decode engine, is the
reference of the added time to first token.

Reported: per variant its best round (the one other processes on a shared machine disturbed
least) and median req/s, proxy cores, proxy CPU per request, the requests per second 16 cores
of workers would reach at that CPU per request; then the cost table, medians over the rounds:
CPU per short request and per stream, the short answers' latency under the saturating load,
the streams' TTFT and the TTFT added over the engines alone (p50 and p99), and the memory.
The machine's load average before and after is printed: run it when the machine is quiet.

Pass criteria (issue 12), checked at the end: ``--workers 2`` uses more than 1.2 cores of
proxy CPU and serves more requests per second than one worker in the same run (which only
free cores beside the proxy allow).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from bench import lean_client
from bench.procs import cpu_seconds, process, wait_healthy
from engines.ports import free_port

MODEL = lean_client.MODEL


@dataclass(frozen=True)
class Round:
    workers: int  # 0: the client straight to the decode engine (the streams' baseline)
    requests: int
    errors: int
    seconds: float
    proxy_cpu: float
    sims_cpu: float
    client_cpu: float
    # the short requests' seconds to their (whole, small) answer, under the load above
    latency_p50: float = float("nan")
    latency_p99: float = float("nan")
    # the streaming phase: --streams paced streams, closed loop
    streams: int = 0
    stream_errors: int = 0
    stream_seconds: float = 0.0
    stream_cpu: float = 0.0
    ttft_p50: float = float("nan")
    ttft_p99: float = float("nan")
    rss_bytes: int = 0  # summed over the process tree, under the streaming load
    pss_bytes: int = 0  # the same, shared pages divided among their sharers

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def proxy_cores(self) -> float:
        return self.proxy_cpu / self.seconds

    @property
    def cpu_ms_per_request(self) -> float:
        return 1000 * self.proxy_cpu / max(1, self.requests)

    @property
    def cpu_ms_per_stream(self) -> float:
        return 1000 * self.stream_cpu / max(1, self.streams)


def _tree(pid: int) -> list[int]:
    """``pid`` and its live children (the supervisor's workers)."""
    with contextlib.suppress(OSError):
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        return [pid, *(int(c) for c in children)]
    return [pid]


def _cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += cpu_seconds(pid)
    return total


def _memory(pids: list[int]) -> tuple[int, int]:
    """(RSS, PSS) in bytes, summed over ``pids``: RSS counts the pages the processes share
    (the interpreter, the libraries) once per process, PSS divides them among the sharers."""
    rss = pss = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                name, _, value = line.partition(":")
                if name in ("Rss", "Pss"):
                    kib = int(value.split()[0]) * 1024
                    rss, pss = (rss + kib, pss) if name == "Rss" else (rss, pss + kib)
    return rss, pss


def _engine_args(args: argparse.Namespace, port: int, role: str) -> list[str]:
    if args.engines == "null":
        cmd = [sys.executable, "-m", "bench.null_engine", "--port", str(port), "--role", role]
        return [*cmd, "--stream-tokens", str(args.stream_tokens), "--stream-tps", str(args.tps)]
    cmd = [sys.executable, "-m", "engines.sim", "--port", str(port), "--role", role]
    cmd += ["--connector", "nixl", "--model", MODEL, "--log-level", "warning"]
    return [*cmd, "--ttft-ms", "0", "--prefill-us-per-token", "0", "--decode-tps", "0"]


@contextlib.asynccontextmanager
async def _sims(args: argparse.Namespace) -> AsyncIterator[tuple[list[str], list[str], list[int]]]:
    """``--sims`` prefill and as many decode engines (instant sims or null engines), each
    its own process."""
    with contextlib.ExitStack() as stack:
        prefills, decodes, pids = [], [], []
        for role, urls in (("prefill", prefills), ("decode", decodes)):
            for i in range(args.sims):
                port = free_port()
                log = f"{args.logdir}/{args.engines}-{role}-{i}.log"
                proc = stack.enter_context(process(_engine_args(args, port, role), log))
                urls.append(f"http://127.0.0.1:{port}")
                pids.append(proc.pid)
        for url in prefills + decodes:
            await wait_healthy(url)
        yield prefills, decodes, pids


async def _phases(
    port: int, pids: list[int], sim_pids: list[int], args: argparse.Namespace
) -> Round:
    """The short requests, then the streams, each after its warm-up, through ``port``;
    CPU read from ``/proc`` around each, memory under the streams."""
    short = lean_client.request(port, args.max_tokens)
    await lean_client.closed_loop(port, short, args.connections, args.warmup)
    before = (_cpu(pids), _cpu(sim_pids), time.process_time())
    started = time.monotonic()
    load = await lean_client.closed_loop(port, short, args.connections, args.seconds)
    seconds = time.monotonic() - started
    after = (_cpu(pids), _cpu(sim_pids), time.process_time())
    streams = lean_client.request(port, args.stream_tokens, stream=True)
    await lean_client.closed_loop(port, streams, args.streams, args.warmup)
    stream_cpu = _cpu(pids)
    started = time.monotonic()
    memory = asyncio.create_task(_memory_at(pids, args.seconds / 2))
    streamed = await lean_client.closed_loop(port, streams, args.streams, args.seconds)
    stream_seconds, stream_cpu = time.monotonic() - started, _cpu(pids) - stream_cpu
    rss, pss = await memory
    return Round(
        0,
        load.ok,
        load.errors,
        seconds,
        proxy_cpu=after[0] - before[0],
        sims_cpu=after[1] - before[1],
        client_cpu=after[2] - before[2],
        latency_p50=lean_client.quantile(load.first_byte, 0.5),
        latency_p99=lean_client.quantile(load.first_byte, 0.99),
        streams=streamed.ok,
        stream_errors=streamed.errors,
        stream_seconds=stream_seconds,
        stream_cpu=stream_cpu,
        ttft_p50=lean_client.quantile(streamed.first_byte, 0.5),
        ttft_p99=lean_client.quantile(streamed.first_byte, 0.99),
        rss_bytes=rss,
        pss_bytes=pss,
    )


async def _memory_at(pids: list[int], delay: float) -> tuple[int, int]:
    await asyncio.sleep(delay)
    return _memory(pids)


async def _round(
    workers: int, sims: tuple[list[str], list[str], list[int]], args: argparse.Namespace
) -> Round:
    """One variant: ``--workers N`` in front of the engines, or (0) the engines alone."""
    prefills, decodes, sim_pids = sims
    if workers == 0:  # the baseline: the client straight to the decode engine
        port = int(decodes[0].rsplit(":", 1)[1])
        return await _phases(port, [], sim_pids, args)
    port = free_port()
    cmd = [sys.executable, "-m", "pdproxy", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--prefill", *prefills, "--decode", *decodes, "--workers", str(workers)]
    cmd += ["--log-level", "warning", "--no-access-log"]
    with process(cmd, f"{args.logdir}/pdproxy-{workers}.log") as proc:
        await wait_healthy(f"http://127.0.0.1:{port}")
        await _until_workers(proc.pid, workers)
        result = await _phases(port, _tree(proc.pid), sim_pids, args)
    return dataclasses.replace(result, workers=workers)


async def _until_workers(pid: int, workers: int) -> None:
    """Every worker is serving (the kernel spreads connections only over open sockets)."""
    deadline = time.monotonic() + 30
    while workers > 1 and len(_tree(pid)) < workers + 1:
        if time.monotonic() > deadline:
            raise RuntimeError("the workers did not start")
        await asyncio.sleep(0.1)
    await asyncio.sleep(2.0 if workers > 1 else 0.0)  # their imports and start-up


def _best(rounds: list[Round], workers: int) -> Round:
    """The variant's least disturbed round: the machine is shared, and a round that other
    processes slowed down says nothing about the proxy (as bench.sched_micro's best of five)."""
    return max((r for r in rounds if r.workers == workers), key=lambda r: r.rps)


def _median(rounds: list[Round], workers: int, figure: Callable[[Round], float]) -> float:
    return statistics.median(figure(r) for r in rounds if r.workers == workers)


def table(rounds: list[Round], cores: int = 16) -> str:
    lines = [
        "| workers | req/s (best) | req/s (median) | proxy cores | proxy CPU/request"
        f" | engines cores | client cores | req/s on {cores} cores (projected) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for workers in sorted({r.workers for r in rounds} - {0}):
        r = _best(rounds, workers)
        lines.append(
            f"| {workers} | {r.rps:,.0f} | {_median(rounds, workers, lambda r: r.rps):,.0f}"
            f" | {r.proxy_cores:.2f} | {r.cpu_ms_per_request:.3f} ms"
            f" | {r.sims_cpu / r.seconds:.2f} | {r.client_cpu / r.seconds:.2f}"
            f" | {cores * 1000 / r.cpu_ms_per_request:,.0f} |"
        )
    return "\n".join(lines)


def cost_table(rounds: list[Round]) -> str:
    """What each variant costs: medians over its rounds; "added" is over the engines alone
    (workers 0) in the same run."""
    lines = [
        "| workers | CPU/request, short | CPU/stream | short answer p50 / p99"
        " | stream TTFT p50 / p99 | added TTFT p50 / p99 | memory RSS (PSS) |",
        "|---|---|---|---|---|---|---|",
    ]
    base = {r.workers for r in rounds}

    def ms(workers: int, figure: Callable[[Round], float]) -> float:
        return 1000 * _median(rounds, workers, figure)

    for workers in sorted(base - {0}):
        p50, p99 = ms(workers, lambda r: r.ttft_p50), ms(workers, lambda r: r.ttft_p99)
        added = "—"
        if 0 in base:
            base50, base99 = ms(0, lambda r: r.ttft_p50), ms(0, lambda r: r.ttft_p99)
            added = f"+{p50 - base50:.1f} / +{p99 - base99:.1f} ms"
        rss = _median(rounds, workers, lambda r: r.rss_bytes) / 2**20
        pss = _median(rounds, workers, lambda r: r.pss_bytes) / 2**20
        short50, short99 = (
            ms(workers, lambda r: r.latency_p50),
            ms(workers, lambda r: r.latency_p99),
        )
        lines.append(
            f"| {workers} | {_median(rounds, workers, lambda r: r.cpu_ms_per_request):.3f} ms"
            f" | {_median(rounds, workers, lambda r: r.cpu_ms_per_stream):.2f} ms"
            f" | {short50:.1f} / {short99:.1f} ms"
            f" | {p50:.1f} / {p99:.1f} ms | {added} | {rss:,.0f} MiB ({pss:,.0f} MiB) |"
        )
    return "\n".join(lines)


def verdicts(rounds: list[Round]) -> list[str]:
    one, two = _best(rounds, 1), _best(rounds, 2)
    failed = []
    if two.proxy_cores <= 1.2:
        failed.append(f"--workers 2 used {two.proxy_cores:.2f} cores of proxy CPU (needs > 1.2)")
    if two.rps <= one.rps:
        failed.append(f"--workers 2 served {two.rps:.0f} req/s, one worker {one.rps:.0f}")
    return failed


async def main_async(args: argparse.Namespace) -> int:
    rounds: list[Round] = []
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    async with _sims(args) as sims:
        for i in range(args.rounds):
            order = (1, 2) if i % 2 == 0 else (2, 1)  # alternate: drift cancels
            for workers in (*order, 0) if args.baseline else order:
                result = await _round(workers, sims, args)
                rounds.append(result)
                print(
                    f"round {i + 1}/{args.rounds} --workers {workers}: {result.rps:,.0f} req/s,"
                    f" {result.proxy_cores:.2f} proxy cores, {result.errors} errors;"
                    f" {result.streams / max(result.stream_seconds, 1e-9):,.0f} streams/s,"
                    f" TTFT p50 {1000 * result.ttft_p50:.1f} ms, {result.stream_errors} errors",
                    flush=True,
                )
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print()
    print(table(rounds))
    print()
    print(cost_table(rounds))
    if args.json:
        rows = [{**r.__dict__, "rps": r.rps, "proxy_cores": r.proxy_cores} for r in rounds]
        await asyncio.to_thread(Path(args.json).write_text, json.dumps(rows, indent=2))
    failed = verdicts(rounds)
    for line in failed:
        print("FAIL:", line)
    if not failed:
        print("PASS: --workers 2 > 1.2 proxy cores and more req/s than one worker")
    return 1 if failed else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per phase")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds first")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of each variant")
    parser.add_argument("--connections", type=int, default=64, help="short-request connections")
    parser.add_argument("--streams", type=int, default=64, help="concurrent streams")
    parser.add_argument("--stream-tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument("--tps", type=float, default=200.0, help="each stream's tokens/s")
    parser.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_false",
        help="skip the rounds straight to the engine (the added TTFT's reference)",
    )
    parser.add_argument(
        "--engines",
        choices=("null", "sim"),
        default="null",
        help="null: canned answers (bench/null_engine.py), so the proxy is the bottleneck;"
        " sim: instant sims (dearer per request than the proxy on a small machine)",
    )
    parser.add_argument("--sims", type=int, default=1, help="prefill and decode engines, each")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per short answer")
    parser.add_argument("--json", default=None, help="write every round here too")
    parser.add_argument("--logdir", default=None, help="where the servers' logs go")
    args = parser.parse_args()
    if args.logdir is None:
        args.logdir = tempfile.mkdtemp(prefix="pdproxy-bench-workers-")
    os.makedirs(args.logdir, exist_ok=True)
    try:
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            sys.exit(runner.run(main_async(args)))
    except ImportError:
        sys.exit(asyncio.run(main_async(args)))


if __name__ == "__main__":
    main()
