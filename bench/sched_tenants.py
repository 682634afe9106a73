"""`make bench-sched`'s multi-tenant run (issue 22 item 8): prefix caches that cannot hold
every tenant, on 4 prefill and 4 decode sims publishing vLLM's KV events.

24 tenants (Zipf-ish popularity) each have a 512-token system prefix; every request adds
a 64-token suffix of its own. Every engine's prefix cache holds 5 whole prompts (180
blocks of 16 tokens), so the prefills together hold under a fifth of the tenants each and
evict all the time; a quarter of the requests come from another client straight to a
random prefill (no router hears of them). Open loop, 12 requests/s for 40 s; the same
request sequence in every column, salted apart so no column reuses another's cache.

Columns: pdproxy with `least-loaded` on both legs, with `prefix-affinity` (its default),
with `kv-events` on both legs (`--kv-events-endpoint`, and `--render-once` so that the
token ids are known), `kv-events` prefills with `least-loaded` decodes, and vllm-router
(PD mode, `cache_aware`, from PyPI into its own venv; skipped with a note when it cannot
be installed or started); and the oracle's hit rate (`bench/tenant_figures.py`).

Figures: the proxied requests' prefill hit rate (their usage's cached tokens, which vLLM
and the sim report through PD), TTFT p50/p90, output tokens/s, the prompt blocks the
decodes loaded over the connector (the sims count the blocks their prefix cache lacked),
and the machine's load average (2 cores shared with whatever else runs).

    python -m bench.sched_tenants [--quick] [--no-anchor] [--columns NAME ...]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

from bench import anchor as anchors
from bench.fleet import metric_sum, run_with_logdir, stop_on_sigterm
from bench.procs import process, wait_healthy
from bench.sched_drive import client_session, metrics_pages, open_loop, serial
from bench.sched_fleet import Shape, SimFleet, proxy, sim_fleet
from bench.sched_workloads import TENANTS_QUICK, Tenants, multi_tenant
from bench.tenant_figures import (
    HELD,
    KV_EVENTS,
    KV_EVENTS_LL,
    LOADED,
    PREFIX_AFFINITY,
    TenantResult,
    decode_blocks,
    oracle_hit_rate,
    summarize,
    table,
    targets,
)
from engines.ports import free_ports

ROUTER = "vllm-router cache_aware"
SERVED = "vllm:request_success_total"
US_PER_TOKEN = 1000.0  # prefill cost per uncached token: a 576-token miss takes 0.58 s


@dataclass(frozen=True)
class Column:
    name: str
    flags: tuple[str, ...] = ()  # pdproxy's
    router_policy: str | None = None  # vllm-router with this policy instead of pdproxy


def columns(events_dir: str) -> list[Column]:
    events = (
        *("--kv-events-endpoint", f"ipc://{events_dir}/{{port}}.events"),
        *("--kv-events-replay-endpoint", f"ipc://{events_dir}/{{port}}.replay"),
        "--render-once",
    )
    return [
        Column(
            "least-loaded", ("--prefill-policy", "least-loaded", "--decode-policy", "least-loaded")
        ),
        Column(
            PREFIX_AFFINITY,
            ("--prefill-policy", "prefix-affinity", "--decode-policy", "least-loaded"),
        ),
        Column(KV_EVENTS, ("--policy", "kv-events", *events)),
        Column(
            KV_EVENTS_LL,
            ("--prefill-policy", "kv-events", "--decode-policy", "least-loaded", *events),
        ),
        Column(ROUTER, router_policy="cache_aware"),
    ]


NAMES = ("least-loaded", PREFIX_AFFINITY, KV_EVENTS, KV_EVENTS_LL, ROUTER)


def shape(t: Tenants, events_dir: str) -> Shape:
    return Shape(
        (US_PER_TOKEN,) * t.prefills,
        prefix_cache_blocks=t.cache_blocks,
        extra=(
            *("--block-size", str(t.block)),
            *("--kv-events-endpoint", f"ipc://{events_dir}/{{port}}.events"),
            *("--kv-events-replay-endpoint", f"ipc://{events_dir}/{{port}}.replay"),
        ),
    )


@contextlib.asynccontextmanager
async def router(
    fleet: SimFleet, col: Column, logdir: str, index: int, anchor: anchors.Anchor | None
) -> AsyncIterator[str]:
    """pdproxy with the column's flags, or vllm-router with its policy; yields its URL."""
    if col.router_policy is None:
        async with proxy(fleet, list(col.flags), f"{logdir}/pdproxy-tenants-{index}.log") as url:
            yield url
        return
    assert anchor is not None
    port, metrics_port = free_ports(2)
    prefills, decodes = [s.url for s in fleet.prefills], [s.url for s in fleet.decodes]
    args = anchor.fleet_command(port, prefills, decodes, metrics_port, col.router_policy)
    with process(args, f"{logdir}/vllm-router-tenants-{index}.log"):
        url = f"http://127.0.0.1:{port}"
        await wait_healthy(url)
        yield url


async def decode_counters(fleet: SimFleet) -> tuple[float, float]:
    """The decodes' (loaded, held) prompt blocks so far, summed."""
    async with client_session() as session:
        pages = await metrics_pages(session, [s.url for s in fleet.decodes])
    return (
        sum(metric_sum(p, LOADED) or 0.0 for p in pages),
        sum(metric_sum(p, HELD) or 0.0 for p in pages),
    )


async def prefill_requests(fleet: SimFleet) -> list[float]:
    """The requests each prefill has served so far."""
    async with client_session() as session:
        pages = await metrics_pages(session, [s.url for s in fleet.prefills])
    return [metric_sum(p, SERVED) or 0.0 for p in pages]


async def measure(
    fleet: SimFleet, col: Column, t: Tenants, logdir: str, index: int, anchor: anchors.Anchor | None
) -> TenantResult:
    plan = multi_tenant(t, salt=f"tenants{index}")
    direct = [s.url for s in fleet.prefills]
    drive = serial if t.serial else open_loop
    async with router(fleet, col, logdir, index, anchor) as url:
        before, served = await decode_counters(fleet), await prefill_requests(fleet)
        async with client_session() as session:
            started = time.perf_counter()
            answers = await drive(session, url, plan, direct)
            seconds = time.perf_counter() - started
        after = await decode_counters(fleet)
        legs = [b - a for a, b in zip(served, await prefill_requests(fleet), strict=True)]
    blocks = decode_blocks(before, after)
    return summarize(col.name, answers, seconds, blocks, os.getloadavg()[0], prefill_legs=legs)


@dataclass(frozen=True)
class Options:
    tenants: Tenants
    names: tuple[str, ...]
    anchor: anchors.Anchor | None
    logdir: str


async def main_async(o: Options) -> tuple[list[TenantResult], list[str]]:
    stop_on_sigterm()
    notes: list[str] = []
    results: list[TenantResult] = []
    chosen = [c for c in columns(o.logdir) if c.name in o.names]
    async with sim_fleet(shape(o.tenants, o.logdir), 4, o.logdir) as fleet:
        for i, col in enumerate(chosen, 1):
            if col.router_policy is not None and o.anchor is None:
                continue
            try:
                r = await measure(fleet, col, o.tenants, o.logdir, i, o.anchor)
            except RuntimeError as e:  # vllm-router that does not start: a note, not a crash
                if col.router_policy is None:
                    raise
                notes.append(f"{col.name}: skipped, it did not start: {e}")
                print(f"skipped: {notes[-1]}", flush=True)
                continue
            results.append(r)
            print(progress(i, len(chosen), r), flush=True)
    return results, notes


def progress(i: int, n: int, r: TenantResult) -> str:
    return (
        f"[{i}/{n}] {r.column:<26} hit {r.hit_rate:6.1%}  TTFT p50 {r.ttft_p50_ms:6.0f} ms"
        f" p90 {r.ttft_p90_ms:6.0f} ms  {r.output_tps:5.0f} tok/s  KV to D"
        f" {r.kv_blocks_loaded:6.0f} blocks  errors {r.errors + r.direct_errors}"
        f"  load {r.load_avg:.1f}  ({r.seconds:.1f} s)"
        f"  prefill legs {[round(n) for n in r.prefill_legs]}"
    )


def get_anchor(args: argparse.Namespace, notes: list[str]) -> anchors.Anchor | None:
    if args.no_anchor or ROUTER not in (args.columns or NAMES):
        return None
    try:
        return anchors.ensure()
    except Exception as e:
        notes.append(f"{ROUTER}: skipped, vllm-router could not be installed: {e!r}")
    print(f"skipped: {notes[-1]}", flush=True)
    return None


def report(
    args: argparse.Namespace,
    t: Tenants,
    results: Sequence[TenantResult],
    notes: list[str],
    load_before: float,
) -> None:
    oracle = oracle_hit_rate(t, multi_tenant(t, salt="oracle"))
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    lines = targets(results, oracle)
    text = (
        f"machine: {machine}; load average at the start {load_before:.1f}\n\n"
        f"{table(results, oracle)}\n\n" + "".join(f"- {line}\n" for line in lines)
    )
    text += "".join(f"\nskipped: {n}" for n in notes)
    print("\n" + text)
    out = Path(args.out_dir)
    stem = "sched-tenants-quick" if args.quick else "sched-tenants"
    stem += f"-rate{t.rate:g}" if args.rate else ""
    stem += "-serial" if args.serial else ""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.md").write_text(text + "\n")
    data = {
        "machine": machine,
        "load_average_at_start": load_before,
        "tenants": asdict(t),
        "oracle_hit_rate": oracle,
        "targets": lines,
        "skipped": notes,
        "results": [r.as_dict() for r in results],
    }
    (out / f"{stem}.json").write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
    print(f"wrote {out / stem}.md and {out / stem}.json")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="A smoke run: 8 tenants, 6 s per column.")
    p.add_argument("--columns", nargs="+", choices=NAMES, help="Default: all.")
    p.add_argument("--no-anchor", action="store_true", help="Leave vllm-router out.")
    p.add_argument("--rate", type=float, help="Requests/s, the other client's included.")
    p.add_argument(
        "--serial",
        action="store_true",
        help="One request at a time (a quiet fleet), no other client: the policy alone.",
    )
    p.add_argument("--out-dir", default="bench/results", help="Where the table and JSON go.")
    p.add_argument("--logdir", default=None, help="Keep process logs here (default: temporary).")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()[0]
    t = TENANTS_QUICK if args.quick else Tenants()
    t = dataclasses.replace(t, rate=args.rate) if args.rate else t
    t = dataclasses.replace(t, serial=True, direct_share=0.0) if args.serial else t
    notes: list[str] = []
    o = Options(t, tuple(args.columns or NAMES), get_anchor(args, notes), "")

    async def run(logdir: str) -> tuple[list[TenantResult], list[str]]:
        return await main_async(dataclasses.replace(o, logdir=logdir))

    results, more = run_with_logdir("pdproxy-bench-tenants-", args.logdir, run)
    report(args, t, results, notes + more, load_before)
    return 0 if all(r.errors + r.direct_errors == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
