"""`make bench-faults`: how pdproxy fares when one engine of a 2P2D sim fleet fails.

Each row starts a fresh fleet (two prefill and two decode sims, nixl, and one pdproxy, each
its own process), runs ``--requests`` requests at ``--concurrency`` (streaming and not,
mixed) and injects the fault after the first ``--fault-after`` answers, so the batch shows
both the switch-over and the steady state:

1. one of two decodes answers 503 (``POST /sim/faults {"status": 503}``);
2. one of two decodes is killed (SIGKILL), then a second batch runs while it is dead; then it
   is started again on the same ports and the time until pdproxy routes to it again is
   measured twice: from pdproxy's ``/status`` (``instances[].routable``, polled every 50 ms)
   and from the sim's own ``requests_received`` counter;
3. one of two prefills hangs (``{"hang": true}``); pdproxy gets ``--prefill-timeout-secs 2``;
4. one of two decodes is killed (SIGKILL) mid-stream, every request streamed with
   ``--mid-stream-tokens`` tokens: with mid-stream migration (the default) and without
   (``--migration-limit 0``), the streams that complete.

A request succeeds only with HTTP 200 and a whole answer (JSON with choices, or a stream of
JSON events without ``error`` ending in ``data: [DONE]``); each has a client timeout.
``--baseline`` runs pdproxy with its fault tolerance turned off (``--max-retries 0``, no
health checks, no ejection): the behaviour before it existed, for the "before" column.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import shlex
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.fleet import (
    Fleet,
    Load,
    LoadSpec,
    Outcome,
    ProxyWatch,
    Sim,
    StallWatch,
    Summary,
    answers_health,
    control_session,
    fleet,
    get_json,
    host_port,
    retries_total,
    run_with_logdir,
    set_faults,
    stop_on_sigterm,
    summarize,
)

# a last hit this close to the batch's last request means the instance never stopped getting them
STILL_RECEIVING_S = 0.5
STOP_TARGET_S = 1.0  # acceptance: a failed instance gets no requests 1 s after the fault
# Fault tolerance off: no retries, no health checks, no ejection (pdproxy before issue 8).
BASELINE = {
    "--max-retries": "0",
    "--health-check-interval-secs": "0",
    "--outlier-consecutive-failures": "0",
}
STALL_NOTE_S = 0.5  # a longer stall of the client itself is reported under the table


@dataclass(frozen=True)
class Options:
    requests: int
    concurrency: int
    fault_after: int
    decode_tps: float
    spec: LoadSpec
    proxy_extra: tuple[str, ...]
    baseline: bool
    rotation_timeout: float
    logdir: str
    mid_stream_tokens: int = 100

    def proxy_args(self, wanted: dict[str, str], notes: list[str]) -> list[str]:
        """The flags a row wants, or with --baseline every fault-tolerance feature off."""
        chosen = BASELINE if self.baseline else wanted
        return [a for flag, value in chosen.items() for a in (flag, value)] + list(self.proxy_extra)


@dataclass
class Row:
    name: str
    summary: Summary
    retries: float | None
    hits: str = "—"  # requests that reached the faulty instance after the fault
    last_hit: str = "—"  # fault → the last of them
    unroutable: str = "—"  # fault → pdproxy's /status calls it not routable
    back: str = "—"  # restart → back in rotation
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Hits:
    """How many requests reached the faulty instance after the fault, and when the last did."""

    count: int
    last: float | None
    fault: float
    last_sent: float  # when the batch sent its last request
    estimated: bool = False  # counted from failures and retries, not from the sim's records

    @classmethod
    def of(cls, times: list[float], fault: float, outcomes: list[Outcome]) -> Hits:
        last_sent = max(x.started for x in outcomes)
        return cls(len(times), max(times, default=None), fault, last_sent)

    def count_text(self) -> str:
        return f"{'≈' if self.estimated else ''}{self.count}"

    def last_text(self, target_s: float | None = None) -> str:
        """``target_s``: the acceptance bound, judged "met" or "MISSED" in the text."""
        if self.last is None:
            return "none after the fault" + (" (met)" if target_s is not None else "")
        if self.last_sent - self.last < STILL_RECEIVING_S:
            text = f"never stopped (hit until the last request, {self.last - self.fault:.2f} s)"
            return text + (" (MISSED)" if target_s is not None else "")
        seconds = self.last - self.fault
        if target_s is None:
            return f"{seconds:.2f} s"
        return f"{seconds:.2f} s (≤ {target_s:g} s: {'met' if seconds <= target_s else 'MISSED'})"


def unroutable_after(watch: ProxyWatch, sim: Sim, fault: float) -> str:
    if not watch.has_instances:
        return "n/a (no /status instances)"
    flipped = watch.first_change(sim.url, routable=False, after=fault)
    return "never" if flipped is None else f"{flipped - fault:.2f} s"


def retries_text(retries: float | None) -> str:
    return "n/a" if retries is None else f"{retries:.0f}"


def record_arrivals(records: list[dict[str, Any]], after: float) -> list[float]:
    """Arrival times of generation requests in a sim's /sim/requests records."""
    return [
        float(r["arrival"])
        for r in records
        if str(r.get("path", "")).startswith("/v1/") and float(r["arrival"]) >= after
    ]


async def batch_with_fault(
    o: Options, proxy_url: str, inject: Callable[[], Awaitable[object]]
) -> tuple[list[Outcome], float]:
    """Run one batch; after ``fault_after`` answers call ``inject``. Returns the fault time."""
    load = Load(proxy_url, o.spec)
    task = asyncio.create_task(load.run(o.requests, o.concurrency))
    try:
        await load.wait_for(o.fault_after)
        fault = time.time()
        await inject()
        return await task, fault
    finally:
        task.cancel()


@contextlib.asynccontextmanager
async def setup(
    o: Options, wanted: dict[str, str], notes: list[str]
) -> AsyncIterator[tuple[Fleet, aiohttp.ClientSession, ProxyWatch]]:
    extra = o.proxy_args(wanted, notes)
    async with fleet(2, 2, o.decode_tps, extra, o.logdir) as f, control_session() as ctl:
        watch = ProxyWatch(f.proxy_url)
        async with watch.running(), StallWatch().running() as stalls:
            yield f, ctl, watch
    if stalls.worst > STALL_NOTE_S:
        notes.append(f"the benchmark's own event loop stalled for up to {stalls.worst:.1f} s")


async def row_decode_503(o: Options) -> list[Row]:
    notes: list[str] = []
    async with setup(o, {}, notes) as (f, ctl, watch):
        victim = f.decodes[1]
        outcomes, fault = await batch_with_fault(
            o, f.proxy_url, lambda: set_faults(ctl, victim, {"status": 503})
        )
        records = await get_json(ctl, victim.url + "/sim/requests")
        retries = await retries_total(ctl, f.proxy_url)
    hits = Hits.of(record_arrivals(records, fault), fault, outcomes)
    row = Row("1. one of two decodes answers 503", summarize(outcomes), retries, notes=notes)
    row.hits, row.last_hit = hits.count_text(), hits.last_text(STOP_TARGET_S)
    row.unroutable = unroutable_after(watch, victim, fault)
    return [row]


async def row_prefill_hang(o: Options) -> list[Row]:
    notes: list[str] = []
    async with setup(o, {"--prefill-timeout-secs": "2"}, notes) as (f, ctl, watch):
        victim = f.prefills[1]
        outcomes, fault = await batch_with_fault(
            o, f.proxy_url, lambda: set_faults(ctl, victim, {"hang": True})
        )
        records = await get_json(ctl, victim.url + "/sim/requests")
        retries = await retries_total(ctl, f.proxy_url)
    hits = Hits.of(record_arrivals(records, fault), fault, outcomes)
    row = Row("3. one of two prefills hangs", summarize(outcomes), retries, notes=notes)
    row.hits, row.last_hit = hits.count_text(), hits.last_text()
    row.unroutable = unroutable_after(watch, victim, fault)
    return [row]


def dead_hits(
    outcomes: list[Outcome], watch: ProxyWatch, retries: float | None, fault: float
) -> Hits:
    """Attempts on a dead instance, which keeps no records: the failed requests plus
    pdproxy's retries; the last one is the later of the last failure and the last retry."""
    end = max(x.ended for x in outcomes)
    times = [x.ended for x in outcomes if not x.ok and x.ended >= fault]
    retried_at = watch.retries_changed_at
    count = len(times) + int(retries or 0)
    if retries and retried_at is not None and fault <= retried_at <= end + 0.1:
        times.append(retried_at)
    last_sent = max(x.started for x in outcomes)
    return Hits(count, max(times, default=None), fault, last_sent, estimated=True)


async def rows_decode_killed(o: Options) -> list[Row]:
    notes: list[str] = []
    async with setup(o, {}, notes) as (f, ctl, watch):
        victim = f.decodes[1]

        async def kill() -> None:
            victim.kill()

        before = await retries_total(ctl, f.proxy_url)
        first, fault = await batch_with_fault(o, f.proxy_url, kill)
        await asyncio.sleep(0.1)  # let the watch see the batch's last retries
        middle = await retries_total(ctl, f.proxy_url)
        hits1 = dead_hits(first, watch, delta(before, middle), fault)
        start2 = time.time()
        second = await Load(f.proxy_url, o.spec).run(o.requests, o.concurrency)
        await asyncio.sleep(0.1)
        after = await retries_total(ctl, f.proxy_url)
        hits2 = dead_hits(second, watch, delta(middle, after), start2)
        back = await back_in_rotation(o, f, victim, watch, ctl, notes)
    row1 = Row("2a. one of two decodes killed (SIGKILL)", summarize(first), delta(before, middle))
    row1.hits, row1.last_hit = hits1.count_text(), hits1.last_text(STOP_TARGET_S)
    row1.unroutable = unroutable_after(watch, victim, fault)
    row2 = Row("2b. second batch, that decode still dead", summarize(second), delta(middle, after))
    row2.hits, row2.back, row2.notes = hits2.count_text(), back, notes
    return [row1, row2]


def delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


async def back_in_rotation(
    o: Options,
    f: Fleet,
    victim: Sim,
    watch: ProxyWatch,
    ctl: aiohttp.ClientSession,
    notes: list[str],
) -> str:
    """Restart ``victim`` on its ports under light load; how long until pdproxy uses it."""
    spawned = time.time()
    victim.start()
    stop = asyncio.Event()
    load = asyncio.create_task(Load(f.proxy_url, o.spec).run(10**9, 4, stop))
    try:
        ready, used = await rotation_times(ctl, victim, watch, spawned + o.rotation_timeout)
    finally:
        stop.set()
        await load
    if ready is None:
        return f"did not start within {o.rotation_timeout:.0f} s"
    notes.append(f"restarted decode answered /health {ready - spawned:.2f} s after spawn")
    by_status = watch.first_change(victim.url, routable=True, after=spawned)
    status_text = "n/a" if not watch.has_instances else since(ready, by_status, o.rotation_timeout)
    return f"{since(ready, used, o.rotation_timeout)} (sim counters), {status_text} (/status)"


def since(start: float, moment: float | None, timeout: float) -> str:
    if moment is None:
        return f"not within {timeout:.0f} s"
    return f"{max(0.0, moment - start):.2f} s"


async def rotation_times(
    ctl: aiohttp.ClientSession, victim: Sim, watch: ProxyWatch, deadline: float
) -> tuple[float | None, float | None]:
    """When the sim answered /health, and when its requests_received first grew; polled
    every 50 ms, until both are seen (and /status says routable, if it can) or the deadline."""
    ready: float | None = None
    used: float | None = None
    while time.time() < deadline:
        now = time.time()
        if ready is None and await answers_health(ctl, victim.url):
            ready = now
        if ready is not None and used is None and await requests_received(ctl, victim) > 0:
            used = now
        routed = not watch.has_instances or watch.routable.get(host_port(victim.url), False)
        if used is not None and routed:
            break
        await asyncio.sleep(0.05)
    return ready, used


async def requests_received(ctl: aiohttp.ClientSession, sim: Sim) -> int:
    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
        counters = await get_json(ctl, sim.url + "/sim/counters")
        return int(counters.get("requests_received", 0))
    return 0


async def rows_decode_killed_mid_stream(o: Options) -> list[Row]:
    """Long streams only; one decode killed while they run, with migration on and off."""
    streams = dataclasses.replace(o, spec=dataclasses.replace(o.spec, stream="all"))
    streams = dataclasses.replace(
        streams, spec=dataclasses.replace(streams.spec, max_tokens=o.mid_stream_tokens)
    )
    rows = []
    for name, flags in (("on", {}), ("off", {"--migration-limit": "0"})):
        notes: list[str] = []
        async with setup(streams, flags, notes) as (f, ctl, watch):
            victim = f.decodes[1]

            async def kill(victim: Sim = victim) -> None:
                victim.kill()

            before = await retries_total(ctl, f.proxy_url)
            outcomes, fault = await batch_with_fault(streams, f.proxy_url, kill)
            after = await retries_total(ctl, f.proxy_url)
            migrated = await migrations_total(ctl, f.proxy_url)
        row = Row(
            f"4{'ab'[name == 'off']}. a decode killed mid-stream, migration {name}",
            summarize(outcomes),
            delta(before, after),
            notes=[*notes, f"streams migrated: {migrated:.0f}"],
        )
        row.unroutable = unroutable_after(watch, victim, fault)
        rows.append(row)
    return rows


async def migrations_total(ctl: aiohttp.ClientSession, proxy_url: str) -> float:
    """pdproxy's ``pdproxy_migrations_total{outcome="migrated"}``, summed over reasons."""
    async with ctl.get(proxy_url + "/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pdproxy_migrations_total{") and 'outcome="migrated"' in line
    )


ROWS: dict[str, Callable[[Options], Awaitable[list[Row]]]] = {
    "1": row_decode_503,
    "2": rows_decode_killed,
    "3": row_prefill_hang,
    "4": rows_decode_killed_mid_stream,
}

COLUMNS = (
    "row",
    "succeeded",
    "success",
    "p50",
    "p99",
    "max",
    "retries",
    "failures",
    "requests to faulty after fault",
    "fault → last of them",
    "fault → not routable (/status)",
    "restart → back in rotation",
)


def cells(row: Row) -> list[str]:
    s = row.summary
    failures = ", ".join(f"{kind} {n}" for kind, n in s.failures.items()) or "—"
    return [
        row.name,
        f"{s.ok}/{s.total}",
        f"{s.success_pct:.1f} %",
        f"{s.p50_ms:.0f} ms",
        f"{s.p99_ms:.0f} ms",
        f"{s.max_ms:.0f} ms",
        retries_text(row.retries),
        failures,
        row.hits,
        row.last_hit,
        row.unroutable,
        row.back,
    ]


def table(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells(row)) + " |" for row in rows]
    return "\n".join(lines)


async def main_async(o: Options, which: list[str]) -> None:
    stop_on_sigterm()
    rows: list[Row] = []
    for key in which:
        rows += await ROWS[key](o)
        print(f"done: row {key}", flush=True)
    mode = "baseline (no fault-tolerance flags)" if o.baseline else "fault-tolerance flags"
    extra = " ".join(o.proxy_extra) or "none"
    print(f"\npdproxy: {mode}; extra args: {extra}")
    print(f"{o.requests} requests per batch at concurrency {o.concurrency}, ", end="")
    print(f"fault after {o.fault_after} answers, client timeout {o.spec.timeout_s:.0f} s\n")
    print(table(rows))
    for row in rows:
        for note in dict.fromkeys(row.notes):
            print(f"- {row.name.split('.')[0]}: {note}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--rows", nargs="*", choices=sorted(ROWS), default=sorted(ROWS))
    p.add_argument("--requests", type=int, default=400, help="Requests per batch.")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--fault-after", type=int, default=40, help="Answers before the fault.")
    p.add_argument("--decode-tps", type=float, default=100.0, help="Sim tokens/s per stream.")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--stream", choices=("none", "mixed", "all"), default="mixed")
    p.add_argument("--timeout", type=float, default=30.0, help="Client timeout per request.")
    p.add_argument("--baseline", action="store_true", help="No fault-tolerance flags.")
    p.add_argument("--proxy-args", default="", help='Extra pdproxy flags, e.g. "--max-retries 3".')
    p.add_argument("--rotation-timeout", type=float, default=60.0)
    p.add_argument("--mid-stream-tokens", type=int, default=100, help="Row 4's max_tokens.")
    p.add_argument("--logdir", default=None, help="Keep the servers' logs here.")
    return p.parse_args()


def options(args: argparse.Namespace, logdir: str) -> Options:
    return Options(
        requests=args.requests,
        concurrency=args.concurrency,
        fault_after=args.fault_after,
        decode_tps=args.decode_tps,
        spec=LoadSpec(max_tokens=args.max_tokens, stream=args.stream, timeout_s=args.timeout),
        proxy_extra=tuple(shlex.split(args.proxy_args)),
        baseline=args.baseline,
        rotation_timeout=args.rotation_timeout,
        logdir=logdir,
        mid_stream_tokens=args.mid_stream_tokens,
    )


def main() -> None:
    args = parse_args()
    run_with_logdir(
        "pdproxy-faults-", args.logdir, lambda logdir: main_async(options(args, logdir), args.rows)
    )


if __name__ == "__main__":
    main()
