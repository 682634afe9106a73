"""Where each router's CPU goes under one of ``make bench``'s loads: the kernel (sockets),
the router's own code, its event loop, libc.

    python -m bench.cpu_split --only b          # pdproxy (defaults) and vllm-router
    python -m bench.cpu_split --only a b-chat --rounds 2

pdproxy on its default flags and vllm-router (the bench's anchor, its cheapest
configuration) run in front of the same two sims (``bench.run.sim_deployment``); each
measured round sends the scenario's load through one router, then the other, the order
reversed every other round, while ``perf record -e cpu-clock`` samples that router's
process (a software clock: it works where a VM exposes no CPU counters). Each router's
samples are then grouped by the file their code lies in (``perf report --sort dso``) and
scaled to its CPU per request, read from ``/proc`` as ``bench.run`` reads it. Both routers
make the same socket calls per token, so the kernel's share shows how much of a router's
cost no user-space change can remove.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from bench import anchor as anchors
from bench import load
from bench.procs import tree_cpu_seconds
from bench.run import sim_deployment
from bench.scenarios import Scenario, selected

# A code file's group: the first group whose marker its name contains.
GROUPS = (
    ("kernel", "[kernel"),
    ("python", "libpython"),
    ("router code", "vllm_router"),
    ("event loop (uvloop)", "uvloop"),
    ("event loop (uvloop)", "loop.cpython"),
    ("libc", "libc.so"),
)
OTHER = "other (parsers, orjson, ...)"
WARMUP = 100


@dataclass
class Split:
    """One router's CPU over its measured rounds: seconds, requests, perf samples by group."""

    cpu_seconds: float = 0.0
    requests: int = 0
    samples: Counter[str] | None = None

    def per_request_ms(self) -> float:
        return 1000 * self.cpu_seconds / max(self.requests, 1)

    def shares(self) -> dict[str, float]:
        samples = self.samples or Counter()
        total = sum(samples.values()) or 1
        return {group: n / total for group, n in samples.most_common()}


def group_of(dso: str) -> str:
    for group, marker in GROUPS:
        if marker in dso:
            return group
    return OTHER


def parse_report(text: str) -> Counter[str]:
    """``perf report --sort dso --stdio`` lines (``  44.20%  [kernel.kallsyms]``) as
    percentage points by group."""
    out: Counter[str] = Counter()
    for line in text.splitlines():
        share, _, dso = line.strip().partition("%")
        if not dso or line.lstrip().startswith("#"):
            continue
        with contextlib.suppress(ValueError):
            out[group_of(dso.strip())] += float(share)
    return out


@contextlib.asynccontextmanager
async def recorded(pid: int, path: str) -> AsyncIterator[None]:
    """``perf record`` of ``pid`` (every thread) for the block's length."""
    args = ["perf", "record", "-q", "-e", "cpu-clock", "-F", "499", "-p", str(pid), "-o", path]
    perf = await asyncio.create_subprocess_exec(
        *args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    await asyncio.sleep(0.5)  # attached before the load starts
    try:
        yield
    finally:
        perf.send_signal(signal.SIGINT)
        await asyncio.wait_for(perf.wait(), 30)


def report(path: str) -> Counter[str]:
    done = subprocess.run(
        ["perf", "report", "-i", path, "--sort", "dso", "--stdio", "-g", "none"],
        capture_output=True,
        text=True,
        check=True,
    )
    return parse_report(done.stdout)


async def measure(scenario: Scenario, anchor: anchors.Anchor, rounds: int, tmp: str) -> dict:
    total = scenario.total
    splits = {"pdproxy": Split(samples=Counter()), "vllm-router": Split(samples=Counter())}
    async with (
        sim_deployment(scenario.decode_tps, tmp, None, anchor) as d,
        load.client() as session,
    ):
        assert d.anchor_url is not None
        routes = [
            ("pdproxy", d.proxy_url, d.proxy_pid),
            ("vllm-router", d.anchor_url, d.anchor_pid),
        ]
        kwargs = dict(max_tokens=scenario.max_tokens, api=scenario.api, session=session)
        for _, url, _ in routes:
            await load.run(url, concurrency=scenario.concurrency, total=WARMUP, **kwargs)
        for r in range(rounds):
            for name, url, pid in routes if r % 2 == 0 else routes[::-1]:
                path = os.path.join(tmp, f"{name}-{r}.perf")
                split = splits[name]
                async with recorded(pid, path):
                    before = tree_cpu_seconds(pid)
                    result = await load.run(
                        url, concurrency=scenario.concurrency, total=total, **kwargs
                    )
                    split.cpu_seconds += tree_cpu_seconds(pid) - before
                split.requests += result.requests
                assert split.samples is not None
                split.samples.update(await asyncio.to_thread(report, path))
    return splits


def table(scenario: Scenario, splits: dict[str, Split]) -> str:
    groups: list[str] = []
    for split in splits.values():
        groups += [g for g in split.shares() if g not in groups]
    head = ["router", "CPU/request", *groups]
    lines = [f"**{scenario.name}**", "", "| " + " | ".join(head) + " |"]
    lines.append("|" + "---|" * len(head))
    for name, split in splits.items():
        per, shares = split.per_request_ms(), split.shares()
        cells = [
            f"{per * shares[g]:.3f} ms ({100 * shares[g]:.0f} %)" if g in shares else "-"
            for g in groups
        ]
        lines.append(f"| {name} | {per:.3f} ms | " + " | ".join(cells) + " |")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> None:
    anchor = anchors.ensure(args.anchor_venv, args.anchor_version)
    for scenario in (s for s in selected(args.only) if not s.real):  # sims only
        with tempfile.TemporaryDirectory(prefix="pdproxy-cpu-split-") as tmp:
            splits = await measure(scenario, anchor, args.rounds, tmp)
        print(table(scenario, splits) + "\n", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", help="scenario ids, e.g. a b (default: every sim one)")
    p.add_argument("--rounds", type=int, default=2, help="measured rounds per router")
    p.add_argument("--anchor-version", default=anchors.VERSION)
    p.add_argument("--anchor-venv", type=Path, default=anchors.VENV)
    args = p.parse_args(argv)
    if shutil.which("perf") is None:
        print("perf is not installed (Debian: linux-perf)", file=sys.stderr)
        return 2
    asyncio.run(main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
