"""`make bench-sched`: pdproxy's scheduling policies on a 4P4D sim fleet, three workloads.

Every engine is a sim process (NIXL). Prefill time is proportional to the prompt tokens not in
the engine's prefix cache, and each engine computes at most `--prefill-concurrency` prompts at
once (the rest queue), so load and cache placement show in TTFT. Workloads
(`bench/sched_workloads.py`):

1. heterogeneous: one prefill is 4x slower per token; a steady Poisson stream of medium prompts.
2. chat: 32 sessions over 4 short shared system prompts, 8 turns each resending the growing
   history; the engines' prefix caches hold 512 blocks (8,192 tokens) each, about a quarter
   of the sessions' histories, so placement decides what stays cached.
3. bursty: bursts of many short prompts plus a few long ones; run again as bursty-pd256 with
   `--pd-threshold-tokens 256`, where short prompts go to a decode alone.

The prefill policy varies with the decode policy fixed, except in bursty-pd256 where the
decode policy varies (decode-only requests are prefilled there). For each run: TTFT p50/p99,
output tokens/s, the prefills' prefix-cache hit rate (from their /metrics), prefill load
imbalance (the busiest prefill's in-flight averaged over the run, over the mean of those
averages; sampled every 100 ms) and the share of decode-only requests
(pdproxy's `pdproxy_decode_only_requests_total`). pdproxy is restarted for each run, the
engines once per fleet shape; each run salts its prompts, so no run reuses another's cache.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import os
import platform
import shlex
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.fleet import metric_sum, run_with_logdir, stop_on_sigterm
from bench.sched_drive import (
    InflightSampler,
    client_session,
    conversations,
    metrics_pages,
    open_loop,
)
from bench.sched_fleet import Shape, SimFleet, proxy, proxy_help, sim_fleet
from bench.sched_report import chart, kind_table, table, write_json
from bench.sched_stats import DECODE_ONLY, Answer, Observed, RunResult, cache_totals, summarize
from bench.sched_workloads import QUICK, Sizes, bursty, chat_sessions, heterogeneous
from pdproxy.config.scheduling import POLICIES

QUICK_POLICIES = ("round-robin", "least-loaded", "prefix-affinity")
BASELINE = "round-robin"  # pdproxy before issue 10; the fixed role's policy by default
FAST_US, SLOW_US = 1000.0, 4000.0  # prefill cost per uncached token, in microseconds
DECODES = 4

Load = Callable[[aiohttp.ClientSession, str, Sizes, str], Awaitable[list[Answer]]]


async def _heterogeneous(s: aiohttp.ClientSession, url: str, z: Sizes, salt: str) -> list[Answer]:
    return await open_loop(s, url, heterogeneous(z, salt))


async def _bursty(s: aiohttp.ClientSession, url: str, z: Sizes, salt: str) -> list[Answer]:
    return await open_loop(s, url, bursty(z, salt))


async def _chat(s: aiohttp.ClientSession, url: str, z: Sizes, salt: str) -> list[Answer]:
    return await conversations(s, url, chat_sessions(z, salt), z.max_tokens)


@dataclass(frozen=True)
class Workload:
    name: str
    shape: Shape
    load: Load
    varied: str  # the role whose policy varies: "prefill" or "decode"
    proxy_flags: tuple[str, ...] = ()


EVEN = Shape((FAST_US,) * 4)
WORKLOADS = (
    Workload(
        "heterogeneous", Shape((FAST_US, FAST_US, FAST_US, SLOW_US)), _heterogeneous, "prefill"
    ),
    Workload("chat", Shape((FAST_US,) * 4, prefix_cache_blocks=384), _chat, "prefill"),
    Workload("bursty", EVEN, _bursty, "prefill"),
    Workload("bursty-pd256", EVEN, _bursty, "decode", ("--pd-threshold-tokens", "256")),
)


@dataclass(frozen=True)
class Run:
    workload: Workload
    policy: str
    fixed: str
    explicit: bool = True  # this pdproxy has --prefill-policy/--decode-policy

    @property
    def other(self) -> str:
        return "decode" if self.workload.varied == "prefill" else "prefill"

    def flags(self) -> list[str]:
        """Both roles' policies, named even when round-robin: pdproxy's defaults differ.

        A pdproxy without the policy flags only does round-robin, and gets no policy flag.
        """
        flags = list(self.workload.proxy_flags)
        if self.explicit:
            flags += [f"--{self.workload.varied}-policy", self.policy]
            flags += [f"--{self.other}-policy", self.fixed]
        return flags


@dataclass(frozen=True)
class Options:
    sizes: Sizes
    policies: tuple[str, ...]
    workloads: tuple[str, ...]
    fixed: str
    proxy_extra: tuple[str, ...]
    interval: float
    logdir: str


def plan(o: Options, help_text: str) -> tuple[list[Run], list[str]]:
    """The runs this pdproxy can do, and a note for each one it cannot."""
    known = _flags(help_text)
    explicit = {"--prefill-policy", "--decode-policy"} <= known
    runs, skipped = [], []
    for w in (w for w in WORKLOADS if w.name in o.workloads):
        for policy in o.policies:
            run = Run(w, policy, o.fixed, explicit)
            missing = sorted({f for f in run.flags() if f.startswith("--")} - known)
            if not explicit and (policy, o.fixed) != (BASELINE, BASELINE):
                missing.append(f"--{w.varied}-policy")
            if missing:
                skipped.append(f"{w.name} / {policy}: this pdproxy has no {', '.join(missing)}")
            else:
                runs.append(run)
    return runs, skipped


def _flags(help_text: str) -> set[str]:
    return {word.strip(",[]") for word in help_text.split() if word.startswith(("--", "[--"))}


async def decode_only_total(session: aiohttp.ClientSession, proxy_url: str) -> float:
    async with session.get(proxy_url + "/metrics") as r:
        return metric_sum(await r.text(), DECODE_ONLY) or 0.0


async def observe(fleet: SimFleet, url: str, run: Run, o: Options, salt: str) -> Observed:
    """One run's load against pdproxy at `url`, with the engines' figures around it."""
    prefills = [s.url for s in fleet.prefills]
    async with client_session() as session:
        before = cache_totals(await metrics_pages(session, prefills))
        only_before = await decode_only_total(session, url)
        sampler = InflightSampler(session, prefills, o.interval)
        async with sampler.running():
            started = time.perf_counter()
            answers = await run.workload.load(session, url, o.sizes, salt)
            seconds = time.perf_counter() - started
        after = cache_totals(await metrics_pages(session, prefills))
        only = await decode_only_total(session, url) - only_before
    return Observed(answers, seconds, before, after, sampler.samples, only)


async def measure(fleet: SimFleet, run: Run, o: Options, index: int) -> RunResult:
    flags = [*run.flags(), *o.proxy_extra]
    log = f"{o.logdir}/pdproxy-{index}.log"
    async with proxy(fleet, flags, log) as url:
        obs = await observe(fleet, url, run, o, salt=f"run{index}")
    return summarize(run.workload.name, run.policy, run.workload.varied, run.fixed, obs)


def progress(i: int, n: int, r: RunResult) -> str:
    return (
        f"[{i}/{n}] {r.workload:<13} {r.varied}={r.policy:<15} "
        f"TTFT p50 {r.ttft_p50_ms:6.0f} ms p99 {r.ttft_p99_ms:6.0f} ms  "
        f"hit {r.hit_rate:6.1%}  imbalance {r.imbalance:4.2f}  "
        f"decode-only {r.decode_only_share:4.0%}  errors {r.errors}  ({r.seconds:.1f} s)"
    )


async def main_async(o: Options) -> tuple[list[RunResult], list[str]]:
    stop_on_sigterm()
    runs, skipped = plan(o, await asyncio.to_thread(proxy_help))
    for note in skipped:
        print(f"skipped: {note}", flush=True)
    results: list[RunResult] = []
    for shape, group in itertools.groupby(runs, key=lambda r: r.workload.shape):
        async with sim_fleet(shape, DECODES, o.logdir) as fleet:
            for run in group:
                results.append(await measure(fleet, run, o, len(results) + 1))
                print(progress(len(results), len(runs), results[-1]), flush=True)
    return results, skipped


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    add = p.add_argument
    add(
        "--quick", action="store_true", help="A smoke run of about a minute: less load, 3 policies."
    )
    add("--policies", nargs="+", choices=POLICIES, help="Policies to run (default: all).")
    add("--workloads", nargs="+", choices=[w.name for w in WORKLOADS], help="Default: all.")
    add("--fixed-policy", default=BASELINE, choices=POLICIES, help="The other role's policy.")
    add("--proxy-args", default="", help="More pdproxy flags for every run, one string.")
    add("--sample-interval", type=float, default=0.1, help="Seconds between load samples.")
    add("--out-dir", default="bench/results", help="Where the table and JSON go.")
    add("--chart", default=None, help="PNG path (default docs/sched-bench.png, quick: out-dir).")
    add("--logdir", default=None, help="Keep process logs here (default: a temporary folder).")
    return p.parse_args()


def options(args: argparse.Namespace, logdir: str) -> Options:
    default_policies = QUICK_POLICIES if args.quick else POLICIES
    return Options(
        sizes=QUICK if args.quick else Sizes(),
        policies=tuple(args.policies or default_policies),
        workloads=tuple(args.workloads or [w.name for w in WORKLOADS]),
        fixed=args.fixed_policy,
        proxy_extra=tuple(shlex.split(args.proxy_args)),
        interval=args.sample_interval,
        logdir=logdir,
    )


def report(
    args: argparse.Namespace, o: Options, results: list[RunResult], notes: list[str]
) -> None:
    stem = "sched-quick" if args.quick else "sched"
    out = Path(args.out_dir)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    text = f"machine: {machine}\n\n{table(results)}\n"
    if kinds := kind_table(results):
        text += f"\n{kinds}\n"
    print("\n" + text)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text + "".join(f"\nskipped: {n}" for n in notes))
    meta = {"machine": machine, "sizes": asdict(o.sizes), "skipped": notes}
    write_json(out / f"{stem}.json", results, meta)
    png = Path(args.chart or (out / f"{stem}.png" if args.quick else "docs/sched-bench.png"))
    if not results:
        return
    try:
        chart(png, results)
    except ImportError:
        print("no chart: matplotlib is not installed (pip install -e '.[bench]')")
        return
    print(f"wrote {out / stem}.md, {out / stem}.json and {png}")


def main() -> None:
    args = parse_args()
    o = options(args, logdir="")

    def run(logdir: str) -> Coroutine[Any, Any, tuple[list[RunResult], list[str]]]:
        return main_async(dataclasses.replace(o, logdir=logdir))

    results, notes = run_with_logdir("pdproxy-bench-sched-", args.logdir, run)
    report(args, o, results, notes)


if __name__ == "__main__":
    main()
