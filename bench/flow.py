"""`make bench-flow`: who goes first when the fleet is full (issue 31's acceptance), each
scenario beside the same run with flow control off.

A 1P1D sim fleet with fixed work per request (`--ttft-ms`, a fixed number of tokens at
`--decode-tps`), behind a pdproxy whose `--max-concurrent-requests` makes the capacity:
with the defaults, 6 slots of ~0.3 s, about 20 requests/s. "on" is pdproxy with a tenants
file and `--tenant-header X-Tenant`; "off" is the same pdproxy without them (one FIFO
queue; a deadline header is still honoured, as it is without a tenants file).

- **priority**: a batch tenant (priority 10) offers 2x capacity, an interactive one
  (priority 0) a fifth of it; the interactive TTFT p99 against the same tenant alone
  (target: within 3x), and the batch tenant's completions against half of the capacity
  left to it.
- **fairness**: a tenant floods at 2x capacity, another keeps 6 requests in flight (same
  priority and weight): the second's completions against 80 % of min(its demand, half the
  capacity); then two tenants of weights 3 and 1 both flood: their completions' ratio
  while both are backlogged (target: within 20 % of 3).
- **deadlines**: a tenant floods until more than 5 s of work is queued; then its own
  requests with `x-slo-ttft-ms: 300` (refused within 100 ms with `Retry-After`, target) and
  another tenant's with `x-slo-ttft-ms: 1000` (the admitted ones meet it >= 95 %, target);
  the median error of pdproxy's TTFT prediction (its `/status`).
- **limits**: a tenant with `tokens_per_minute: 1000` sends ~100-token requests one after
  another (refused with `x-ratelimit-*` after about 10, target), another tenant beside it
  (never refused, target).

    python -m bench.flow [--quick] [--seconds S] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.fleet import proxy_command, run_with_logdir, stop_on_sigterm
from bench.procs import process, wait_healthy
from bench.sched_fleet import TunedSim
from engines.ports import free_ports

SLOTS = 6  # --max-concurrent-requests: the fleet's capacity is SLOTS / service time
TTFT_MS = 100.0  # each sim's: the prefill leg's, then the decode's first token
TOKENS = 10  # each request's completion
TPS = 100.0  # 10 tokens at 100/s: 0.1 s after the first; ~0.3 s a request in all
SERVICE_S = 2 * TTFT_MS / 1000 + TOKENS / TPS  # one request, prefill and decode
# The steady tenant's requests in flight: its fair share is half the slots (3), and a closed
# loop spends each request's turn-around (the client reading the end, sending the next, pdproxy
# reading it) with one fewer waiting. With 4, one slack request: a slot freed during a
# turn-around went to the flood, and on a loaded runner (25 ms turn-arounds) it held 0.75 of
# its share. With 6, three slots must free within one turn-around for it to lose one.
STEADY_IN_FLIGHT = 6
CAPACITY = SLOTS / SERVICE_S  # requests a second
PROMPT = "flow " * 16  # ~20 tokens by pdproxy's estimate (4 characters a token)
METERED_PROMPT = "flow " * 72  # ~90 tokens: with its 10 asked for, ~100 a request
TENANTS = {
    "default": {"weight": 1},
    "interactive": {"weight": 1, "priority": 0},
    "batch": {"weight": 1, "priority": 10},
    "flood": {"weight": 1},
    "steady": {"weight": 1},
    "heavy": {"weight": 3},
    "light": {"weight": 1},
    "metered": {"tokens_per_minute": 1000},
    "free": {},
}
_TIMEOUT = aiohttp.ClientTimeout(total=60)


@dataclass
class Result:
    tenant: str
    sent: float  # perf_counter
    status: int = 0
    ttft: float | None = None  # seconds to the first body byte
    done: float | None = None
    retry_after: str | None = None
    ratelimit: bool = False  # x-ratelimit-* headers present


@dataclass
class Figures:
    scenario: str
    column: str  # "on" or "off"
    seconds: float
    figures: dict[str, Any] = field(default_factory=dict)


def _p(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Driver:
    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session = session
        self.url = url
        self.results: list[Result] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def one(
        self, tenant: str, deadline_ms: float | None = None, prompt: str = PROMPT
    ) -> Result:
        headers = {"X-Tenant": tenant}
        if deadline_ms is not None:
            headers["x-slo-ttft-ms"] = str(deadline_ms)
        body = {
            "model": "sim-model",
            "prompt": prompt,
            "max_tokens": TOKENS,
            "min_tokens": TOKENS,
            "stream": True,
            "ignore_eos": True,
        }
        result = Result(tenant, time.perf_counter())
        self.results.append(result)
        try:
            async with self.session.post(
                self.url + "/v1/completions", json=body, headers=headers, timeout=_TIMEOUT
            ) as response:
                result.status = response.status
                result.retry_after = response.headers.get("retry-after")
                result.ratelimit = "x-ratelimit-limit-tokens" in response.headers
                first = True
                async for _ in response.content.iter_any():
                    if first:
                        result.ttft = time.perf_counter() - result.sent
                        first = False
        except (aiohttp.ClientError, asyncio.TimeoutError):
            result.status = result.status or 599
        result.done = time.perf_counter()
        return result

    def fire(self, tenant: str, deadline_ms: float | None = None) -> None:
        task = asyncio.create_task(self._quiet(tenant, deadline_ms))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _quiet(self, tenant: str, deadline_ms: float | None) -> None:
        await self.one(tenant, deadline_ms)

    async def open_loop(
        self, tenant: str, rate: float, seconds: float, deadline_ms: float | None = None
    ) -> None:
        """``rate`` requests a second, evenly spaced, for ``seconds``."""
        start = time.perf_counter()
        n = int(rate * seconds)
        for i in range(n):
            delay = start + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            self.fire(tenant, deadline_ms)

    async def closed_loop(self, tenant: str, in_flight: int, seconds: float) -> None:
        end = time.perf_counter() + seconds

        async def worker() -> None:
            while time.perf_counter() < end:
                result = await self.one(tenant)
                if result.status != 200:
                    await asyncio.sleep(0.05)

        await asyncio.gather(*(worker() for _ in range(in_flight)))

    async def drain(self, grace: float = 2.0) -> None:
        """The requests fired have ``grace`` seconds to finish; the rest are cut (what a
        scenario counts ended before: a flood's queue would take its timeout to empty)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def ok(self, tenant: str, since: float = 0.0, until: float = float("inf")) -> list[Result]:
        return [
            r
            for r in self.results
            if r.tenant == tenant and r.status == 200 and r.done and since <= r.done < until
        ]


@contextlib.asynccontextmanager
async def fleet(logdir: str) -> AsyncIterator[list[TunedSim]]:
    ports = free_ports(4)
    flags = ("--ttft-ms", str(TTFT_MS), "--max-running", "256")
    sims = [
        TunedSim("prefill-0", "prefill", ports[0], ports[1], TPS, logdir, extra=flags),
        TunedSim("decode-0", "decode", ports[2], ports[3], TPS, logdir, extra=flags),
    ]
    with contextlib.ExitStack() as stack:
        for sim in sims:
            stack.callback(sim.stop)
            sim.start()
        for sim in sims:
            await wait_healthy(sim.url)
        yield sims


@contextlib.asynccontextmanager
async def pdproxy(sims: list[TunedSim], column: str, logdir: str, name: str) -> AsyncIterator[str]:
    (port,) = free_ports(1)
    extra = [
        *("--max-concurrent-requests", str(SLOTS), "--max-queued-requests", "5000"),
        *("--queue-timeout-secs", "10", "--no-access-log"),
    ]
    if column == "on":
        extra += ["--tenants", _tenants_file(logdir), "--tenant-header", "X-Tenant"]
    command = proxy_command(port, list(sims), extra)
    with process(command, f"{logdir}/pdproxy-{name}-{column}.log"):
        url = f"http://127.0.0.1:{port}"
        await wait_healthy(url)
        yield url


def _tenants_file(logdir: str) -> str:
    path = Path(logdir, "tenants.json")
    path.write_text(json.dumps(TENANTS))
    return str(path)


async def _warm(driver: Driver) -> None:
    for _ in range(4):
        await driver.one("default")
    driver.results.clear()


async def priority(driver: Driver, seconds: float) -> dict[str, Any]:
    """The interactive tenant alone, then beside the batch flood."""
    capacity = CAPACITY
    await driver.open_loop("interactive", capacity / 5, min(seconds, 5.0))
    await driver.drain(5.0)
    alone = [r.ttft for r in driver.ok("interactive") if r.ttft is not None]
    driver.results.clear()
    start = time.perf_counter()
    await asyncio.gather(
        driver.open_loop("batch", 2 * capacity, seconds),
        driver.open_loop("interactive", capacity / 5, seconds),
    )
    end = time.perf_counter()
    await driver.drain()
    loaded = [r.ttft for r in driver.ok("interactive", start) if r.ttft is not None]
    batch = len(driver.ok("batch", start, end)) / (end - start)
    interactive_rate = len(driver.ok("interactive", start, end)) / (end - start)
    alone_p99, loaded_p99 = _p(alone, 0.99), _p(loaded, 0.99)
    return {
        "capacity_rps": round(capacity, 1),
        "interactive_ttft_alone_p50_ms": _ms(_p(alone, 0.5)),
        "interactive_ttft_alone_p99_ms": _ms(alone_p99),
        "interactive_ttft_loaded_p50_ms": _ms(_p(loaded, 0.5)),
        "interactive_ttft_loaded_p99_ms": _ms(loaded_p99),
        "interactive_p99_over_alone": _ratio(loaded_p99, alone_p99),
        "interactive_completed_rps": round(interactive_rate, 2),
        "batch_completed_rps": round(batch, 2),
        "batch_share_of_capacity_left": round(batch / (capacity - interactive_rate), 2),
    }


async def fairness(driver: Driver, seconds: float) -> dict[str, Any]:
    capacity = CAPACITY
    # its demand: STEADY_IN_FLIGHT in flight, each served in the time one takes alone
    start = time.perf_counter()
    await asyncio.gather(
        driver.open_loop("flood", 2 * capacity, seconds),
        driver.closed_loop("steady", STEADY_IN_FLIGHT, seconds),
    )
    end = time.perf_counter()
    await driver.drain()
    # from a second in (the flood's queue has formed) to the end: the share under contention,
    # of what the fleet delivered in that window (a loaded machine serves fewer than CAPACITY
    # a second: half of the nominal figure would not be the fair share there)
    window = end - start - 1.0
    steady = len(driver.ok("steady", start + 1.0, end)) / window
    delivered = steady + len(driver.ok("flood", start + 1.0, end)) / window
    demand = STEADY_IN_FLIGHT / SERVICE_S
    owed = min(demand, capacity / 2, delivered / 2)
    driver.results.clear()
    start = time.perf_counter()
    await asyncio.gather(
        driver.open_loop("heavy", 1.5 * capacity, seconds),
        driver.open_loop("light", 1.5 * capacity, seconds),
    )
    end = time.perf_counter()
    await driver.drain()
    # both backlogged: from a second in (the queue has formed) to the arrivals' end
    heavy = len(driver.ok("heavy", start + 1.0, end))
    light = len(driver.ok("light", start + 1.0, end))
    return {
        "delivered_rps": round(delivered, 2),
        "steady_completed_rps": round(steady, 2),
        "steady_owed_rps": round(owed, 2),
        "steady_over_owed": round(steady / owed, 2),
        "weighted_heavy_completed": heavy,
        "weighted_light_completed": light,
        "weighted_ratio": _ratio(heavy, light),
    }


async def deadlines(driver: Driver, seconds: float, url: str) -> dict[str, Any]:
    capacity = CAPACITY
    flood = asyncio.create_task(driver.open_loop("flood", 2 * capacity, seconds + 4.0))
    await asyncio.sleep(4.0)  # 2x capacity for 4 s: > 5 s of work waits
    probes: list[Result] = []
    served: list[Result] = []

    async def probe_loop() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            probes.append(await driver.one("flood", 300))
            await asyncio.sleep(0.25)

    async def interactive_loop() -> None:
        end = time.perf_counter() + seconds
        tasks = []
        while time.perf_counter() < end:
            tasks.append(asyncio.create_task(driver.one("interactive", 1000)))
            await asyncio.sleep(0.5)
        served.extend(await asyncio.gather(*tasks))

    await asyncio.gather(probe_loop(), interactive_loop())
    await flood
    await driver.drain(0.0)
    refused = [p for p in probes if p.status == 429]
    refusal_ms = [(p.done - p.sent) * 1000 for p in refused if p.done]
    admitted = [r for r in served if r.status == 200 and r.ttft is not None]
    met = [r for r in admitted if r.ttft is not None and r.ttft <= 1.0]
    async with driver.session.get(url + "/status") as response:
        status = await response.json()
    prediction = (status.get("flow") or {}).get("prediction") or {}
    return {
        "probes": len(probes),
        "probes_refused": len(refused),
        "probes_refused_with_retry_after": sum(1 for p in refused if p.retry_after),
        "refusal_ms_max": round(max(refusal_ms), 1) if refusal_ms else None,
        "refusal_ms_p50": round(statistics.median(refusal_ms), 1) if refusal_ms else None,
        "deadline_requests": len(served),
        "deadline_admitted": len(admitted),
        "deadline_met_share": round(len(met) / len(admitted), 3) if admitted else None,
        "prediction_median_error_ms": prediction.get("median_error_ms"),
        "prediction_samples": prediction.get("samples"),
    }


async def limits(driver: Driver) -> dict[str, Any]:
    metered: list[Result] = []
    free: list[Result] = []
    for _ in range(16):
        metered.append(await driver.one("metered", prompt=METERED_PROMPT))
        free.append(await driver.one("free", prompt=METERED_PROMPT))
    first_refusal = next((i for i, r in enumerate(metered) if r.status == 429), None)
    return {
        "metered_served_before_refusal": first_refusal
        if first_refusal is not None
        else len(metered),
        "metered_refusals_with_ratelimit_headers": sum(
            1 for r in metered if r.status == 429 and r.ratelimit and r.retry_after
        ),
        "metered_refused": sum(1 for r in metered if r.status == 429),
        "free_refused": sum(1 for r in free if r.status != 200),
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 1)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if not a or not b else round(a / b, 2)


SCENARIOS = ("priority", "fairness", "deadlines", "limits")


async def run(logdir: str, seconds: float, scenarios: tuple[str, ...] = SCENARIOS) -> list[Figures]:
    out: list[Figures] = []
    async with fleet(logdir) as sims:
        for name in scenarios:
            for column in ("on", "off"):
                async with (
                    pdproxy(sims, column, logdir, name) as url,
                    aiohttp.ClientSession(
                        connector=aiohttp.TCPConnector(limit=0, force_close=False)
                    ) as session,
                ):
                    driver = Driver(session, url)
                    await _warm(driver)
                    started = time.perf_counter()
                    figures = await _scenario(name, driver, seconds, url)
                    out.append(
                        Figures(name, column, round(time.perf_counter() - started, 1), figures)
                    )
                    print(f"{name:10} {column:3} {figures}", flush=True)
    return out


def _scenario(name: str, driver: Driver, seconds: float, url: str) -> Awaitable[dict[str, Any]]:
    table: dict[str, Callable[[], Awaitable[dict[str, Any]]]] = {
        "priority": lambda: priority(driver, seconds),
        "fairness": lambda: fairness(driver, seconds),
        "deadlines": lambda: deadlines(driver, seconds, url),
        "limits": lambda: limits(driver),
    }
    return table[name]()


def targets(results: list[Figures]) -> dict[str, bool]:
    """Issue 31's acceptance figures, each from the "on" column."""
    on = {f.scenario: f.figures for f in results if f.column == "on"}
    checks: dict[str, bool] = {}
    if "priority" in on:
        p = on["priority"]
        over = p["interactive_p99_over_alone"]
        checks["interactive TTFT p99 within 3x alone"] = over is not None and over <= 3
        checks["batch >= half the capacity left"] = p["batch_share_of_capacity_left"] >= 0.5
    if "fairness" in on:
        f = on["fairness"]
        checks["steady >= 80 % of its due"] = f["steady_over_owed"] >= 0.8
        checks["weights 3:1 within 20 %"] = 2.4 <= (f["weighted_ratio"] or 0) <= 3.6
    if "deadlines" in on:
        d = on["deadlines"]
        checks["300 ms probes refused within 100 ms"] = (
            d["probes_refused"] == d["probes"] > 0
            and d["probes_refused_with_retry_after"] == d["probes_refused"]
            and (d["refusal_ms_max"] or 1e9) <= 100
        )
        checks["admitted deadlines met >= 95 %"] = (d["deadline_met_share"] or 0) >= 0.95
    if "limits" in on:
        lim = on["limits"]
        checks["limit refuses after ~10 with headers"] = (
            8 <= lim["metered_served_before_refusal"] <= 12
            and lim["metered_refusals_with_ratelimit_headers"] == lim["metered_refused"] > 0
            and lim["free_refused"] == 0
        )
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="6 s a scenario instead of 30")
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--logdir", default=None)
    parser.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=SCENARIOS)
    args = parser.parse_args(argv)
    seconds = args.seconds or (6.0 if args.quick else 30.0)

    async def go(logdir: str) -> list[Figures]:
        stop_on_sigterm()
        return await run(logdir, seconds, tuple(args.scenarios))

    results = run_with_logdir("pdproxy-bench-flow-", args.logdir, go)
    checks = targets(results)
    load = os.getloadavg()[0]
    print(f"\nload average {load:.1f}; python {sys.version.split()[0]}")
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    if args.json:
        payload = {
            "seconds": seconds,
            "load_average": load,
            "results": [asdict(r) for r in results],
            "targets": checks,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
