"""`make soak`: many requests through pdproxy while a seeded schedule breaks one engine at a time.

A 2P2D fleet of sim engines (nixl, each its own process) behind one pdproxy process serves
``--requests`` requests at ``--concurrency``. A background task picks, with a seeded
``random.Random``, an instance and one fault, holds it for a few seconds, clears it, waits a
quiet gap and picks again: status 503 or 429, a hang, refused connections, 3 s before the
response headers, kill -9 and a restart on the same ports, or /health answering 503.
Knobs the sim does not know yet are logged as unsupported (/health 503 falls back to the
sim's ``slow_start_s``). The same seed gives the same sequence of faults.

Reported: success rate, failures by kind, pdproxy's retries (from /metrics, if exported),
latency p50/p99 over all requests, and pdproxy's RSS and open file descriptors at start,
after warm-up (the first 5 % of requests) and at the end. A progress line every ~10 s; a
Markdown summary at the end and the same figures as JSON (``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import shlex
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from bench.fleet import (
    Fleet,
    Load,
    LoadSpec,
    Outcome,
    ProcFigures,
    Sim,
    StallWatch,
    clear_faults,
    control_session,
    fleet,
    proc_figures,
    retries_total,
    run_with_logdir,
    set_faults,
    stop_on_sigterm,
    summarize,
)
from bench.procs import wait_healthy

WARMUP_FRACTION = 0.05
PROGRESS_EVERY_S = 10.0


@dataclass(frozen=True)
class FaultEvent:
    at_s: float  # since the load started
    kind: str
    instance: str
    duration_s: float
    applied: str  # "yes", "fallback: <knob>", "unsupported", "cut short: ..." or "error: ..."


Inject = Callable[["FaultSchedule", Sim, float], Awaitable[str]]


def with_faults(fields: dict[str, Any], fallback: str | None = None) -> Inject:
    """Set ``fields`` for the duration; if the sim rejects them, ``fallback`` (a knob that
    takes the duration in seconds) stands in, else the fault is skipped as unsupported."""

    async def inject(schedule: FaultSchedule, sim: Sim, duration: float) -> str:
        ctl = schedule.ctl
        if await set_faults(ctl, sim, fields):
            applied = "yes"
        elif fallback is not None and await set_faults(ctl, sim, {fallback: duration}):
            applied = f"fallback: {fallback}"
        else:
            return "unsupported"
        try:
            await asyncio.sleep(duration)
        finally:
            await clear_faults(ctl, sim)
        return applied

    return inject


async def refuse(schedule: FaultSchedule, sim: Sim, duration: float) -> str:
    # A number reopens the listener by itself: no connection is needed to clear the fault.
    if not await set_faults(schedule.ctl, sim, {"refuse_connections": duration}):
        return "unsupported"
    await asyncio.sleep(duration)
    return "yes"


async def kill_restart(schedule: FaultSchedule, sim: Sim, duration: float) -> str:
    sim.kill()
    try:
        await asyncio.sleep(duration)
    finally:
        sim.start()
    await wait_healthy(sim.url)
    return "yes"


FAULTS: dict[str, Inject] = {
    "status_503": with_faults({"status": 503}),
    "status_429": with_faults({"status": 429}),
    "hang": with_faults({"hang": True}),
    "refuse_connections": refuse,
    "headers_delay_3s": with_faults({"headers_delay_s": 3}),
    "kill_restart": kill_restart,
    "health_503": with_faults({"health_status": 503}, fallback="slow_start_s"),
}


@dataclass
class FaultSchedule:
    """One fault at a time on a random instance, then a quiet gap; every draw comes from
    ``rng`` in a fixed order, so a seed fixes the sequence of faults."""

    fleet: Fleet
    ctl: aiohttp.ClientSession
    rng: random.Random
    fault_s: tuple[float, float]
    quiet_s: tuple[float, float]
    events: list[FaultEvent] = field(default_factory=list)
    current: str = "none"

    async def run(self, t0: float) -> None:
        while True:
            await asyncio.sleep(self.rng.uniform(*self.quiet_s))
            sim = self.rng.choice(self.fleet.sims)
            kind = self.rng.choice(sorted(FAULTS))
            duration = round(self.rng.uniform(*self.fault_s), 2)
            at = round(time.time() - t0, 2)
            self.current, applied = f"{kind} on {sim.name}", "cut short: the run ended"
            try:
                applied = await FAULTS[kind](self, sim, duration)
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                applied = f"error: {exc!r}"
            finally:
                self.current = "none"
                self.events.append(FaultEvent(at, kind, sim.name, duration, applied))

    async def restore(self) -> None:
        """After the run: every sim up again and without faults."""
        for sim in self.fleet.sims:
            if sim.proc is None:
                sim.start()
            await wait_healthy(sim.url)
            await clear_faults(self.ctl, sim)


@dataclass
class Progress:
    load: Load
    total: int
    pid: int
    schedule: FaultSchedule
    t0: float
    counted: int = 0
    ok: int = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            print(self.line(), flush=True)

    def line(self) -> str:
        done = len(self.load.outcomes)
        self.ok += sum(o.ok for o in self.load.outcomes[self.counted : done])
        self.counted = done
        elapsed = time.time() - self.t0
        figures = proc_figures(self.pid)
        return (
            f"[{elapsed:6.0f} s] {done}/{self.total} done, "
            f"{100 * self.ok / max(done, 1):.2f} % ok, {done / elapsed:.0f} req/s on average, "
            f"fault: {self.schedule.current}, pdproxy rss {figures.rss_kib / 1024:.1f} MiB, "
            f"fds {figures.fds}"
        )


async def figures_after(load: Load, answers: int, pid: int) -> ProcFigures:
    await load.wait_for(answers)
    return proc_figures(pid)


@dataclass(frozen=True)
class Options:
    requests: int
    concurrency: int
    seed: int
    decode_tps: float
    spec: LoadSpec
    proxy_extra: tuple[str, ...]
    fault_s: tuple[float, float]
    quiet_s: tuple[float, float]
    logdir: str


async def soak(o: Options) -> dict[str, Any]:
    stop_on_sigterm()
    async with (
        fleet(2, 2, o.decode_tps, list(o.proxy_extra), o.logdir) as f,
        control_session() as ctl,
        StallWatch().running() as stalls,
    ):
        pid = f.proxy_pid
        start = proc_figures(pid)
        load = Load(f.proxy_url, o.spec)
        schedule = FaultSchedule(f, ctl, random.Random(o.seed), o.fault_s, o.quiet_s)
        t0 = time.time()
        warm = asyncio.create_task(figures_after(load, int(o.requests * WARMUP_FRACTION), pid))
        background = [
            asyncio.create_task(schedule.run(t0)),
            asyncio.create_task(Progress(load, o.requests, pid, schedule, t0).run()),
        ]
        try:
            outcomes = await load.run(o.requests, o.concurrency)
        finally:
            await cancel(background)
        seconds = time.time() - t0
        await schedule.restore()
        await asyncio.sleep(1.0)  # let pdproxy settle (closed streams, idle pools)
        end = proc_figures(pid)
        retries = await retries_total(ctl, f.proxy_url)
    result = report(o, outcomes, seconds, retries, [start, await warm, end], schedule.events)
    return {**result, "client_max_stall_s": round(stalls.worst, 3)}


async def cancel(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def report(
    o: Options,
    outcomes: list[Outcome],
    seconds: float,
    retries: float | None,
    figures: list[ProcFigures],
    events: list[FaultEvent],
) -> dict[str, Any]:
    s = summarize(outcomes)
    warm, end = figures[1], figures[2]
    return {
        "config": {
            **{k: v for k, v in dataclasses.asdict(o).items() if k not in ("spec", "logdir")},
            "spec": dataclasses.asdict(o.spec),
        },
        "requests": s.total,
        "succeeded": s.ok,
        "success_pct": round(s.success_pct, 3),
        "failures": s.failures,
        "retries": retries,
        "seconds": round(seconds, 1),
        "latency_ms": {"p50": s.p50_ms, "p99": s.p99_ms, "max": s.max_ms},
        "pdproxy": {
            "rss_kib": [x.rss_kib for x in figures],
            "fds": [x.fds for x in figures],
            "rss_end_over_warm": round(end.rss_kib / max(warm.rss_kib, 1), 3),
            "fds_end_over_warm": round(end.fds / max(warm.fds, 1), 3),
        },
        "faults": [dataclasses.asdict(e) for e in events],
    }


def markdown(r: dict[str, Any]) -> str:
    kinds = Counter(
        e["kind"] + (f" ({e['applied']})" if e["applied"].startswith("fallback") else "")
        for e in r["faults"]
        if e["applied"] != "unsupported"
    )
    skipped = Counter(e["kind"] for e in r["faults"] if e["applied"] == "unsupported")
    lat = r["latency_ms"]
    rows = [
        ("requests", f"{r['requests']} in {r['seconds']} s"),
        ("succeeded", f"{r['succeeded']} ({r['success_pct']:.2f} %)"),
        ("failures by kind", ", ".join(f"{k} {n}" for k, n in r["failures"].items()) or "none"),
        ("retries (pdproxy)", "n/a" if r["retries"] is None else f"{r['retries']:.0f}"),
        ("latency p50 / p99 / max", f"{lat['p50']:.0f} / {lat['p99']:.0f} / {lat['max']:.0f} ms"),
        ("faults injected", ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) or "none"),
        ("faults skipped (unsupported)", ", ".join(f"{k} {n}" for k, n in skipped.items()) or "—"),
        ("longest stall of the client's own loop", f"{r['client_max_stall_s']:.2f} s"),
    ]
    lines = ["| | |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)]
    p = r["pdproxy"]
    rss = [f"{kib / 1024:.1f} MiB" for kib in p["rss_kib"]]
    lines += [
        "",
        "| pdproxy | start | after warm-up | end | end / after warm-up |",
        "|---|---|---|---|---|",
        f"| RSS | {' | '.join(rss)} | {p['rss_end_over_warm']:.3f} |",
        f"| open fds | {' | '.join(map(str, p['fds']))} | {p['fds_end_over_warm']:.3f} |",
    ]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=1, help="Seed of the fault schedule.")
    p.add_argument("--decode-tps", type=float, default=200.0, help="Sim tokens/s per stream.")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--stream", choices=("none", "mixed", "all"), default="mixed")
    p.add_argument("--timeout", type=float, default=30.0, help="Client timeout per request.")
    p.add_argument(
        "--proxy-args",
        default="--prefill-timeout-secs 5 --decode-header-timeout-secs 5 --request-timeout-secs 5",
        help="pdproxy flags; by default leg timeouts that fit these short requests, so a hung "
        "engine costs seconds, not the client's timeout (a hung non-streaming decode is bounded "
        "only by --request-timeout-secs).",
    )
    p.add_argument(
        "--fault-seconds", type=float, nargs=2, default=(2.0, 5.0), metavar=("MIN", "MAX")
    )
    p.add_argument(
        "--quiet-seconds", type=float, nargs=2, default=(3.0, 8.0), metavar=("MIN", "MAX")
    )
    p.add_argument("--json", default="/tmp/pdproxy-soak.json", help="Where to write the result.")
    p.add_argument("--logdir", default=None, help="Keep the servers' logs here.")
    return p.parse_args()


def options(args: argparse.Namespace, logdir: str) -> Options:
    return Options(
        requests=args.requests,
        concurrency=args.concurrency,
        seed=args.seed,
        decode_tps=args.decode_tps,
        spec=LoadSpec(max_tokens=args.max_tokens, stream=args.stream, timeout_s=args.timeout),
        proxy_extra=tuple(shlex.split(args.proxy_args)),
        fault_s=tuple(args.fault_seconds),
        quiet_s=tuple(args.quiet_seconds),
        logdir=logdir,
    )


def main() -> None:
    args = parse_args()
    result = run_with_logdir(
        "pdproxy-soak-", args.logdir, lambda logdir: soak(options(args, logdir))
    )
    with open(args.json, "wb") as f:
        f.write(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    print()
    print(markdown(result))
    print(f"\nresult: {args.json}")


if __name__ == "__main__":
    main()
