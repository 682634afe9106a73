"""`make bench`: direct-to-decode vs through pdproxy against sim engines, in one run.

Scenarios (issue 3): (a) 32 concurrent streams of 16 tokens as fast as possible, (b) 64
concurrent streams of 128 tokens at 200 tokens/s each, (c) one request at a time. For each:
requests/s, TTFT p50/p99 direct and proxied, the TTFT pdproxy adds, and pdproxy's own CPU
time per request (from /proc). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import shlex
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import load
from bench.procs import cpu_seconds, process, proxy_args, sim_args, wait_healthy
from engines.ports import free_port, free_ports


@dataclass(frozen=True)
class Scenario:
    name: str
    concurrency: int
    max_tokens: int
    decode_tps: float
    total: int
    target_cpu_ms: float | None = None
    target_added_ttft_ms: float | None = None
    real: bool = False  # real vLLM CPU engines instead of simulated ones


SCENARIOS = (
    Scenario("(a) 32 concurrent, 16 tokens", 32, 16, 0, 4000, target_cpu_ms=0.8),
    Scenario("(b) 64 concurrent, 128 tokens @200 tok/s", 64, 128, 200, 640, target_cpu_ms=4.0),
    Scenario("(c) one at a time, 16 tokens", 1, 16, 0, 1000, target_added_ttft_ms=1.0),
    Scenario("(d) real vLLM 1P1D (NIXL), 4 concurrent, 16 tokens", 4, 16, 0, 120, real=True),
)


@dataclass(frozen=True)
class Deployment:
    decode_url: str
    proxy_url: str
    proxy_pid: int
    model: str
    variant_url: str | None = None  # a second pdproxy, configured as the --variant says
    variant_pid: int = 0


BENCH_KEY = "sk-bench-5f3c9a1e"


@dataclass(frozen=True)
class Variant:
    """A second pdproxy measured beside the plain one, alternately, in the same run."""

    title: str
    args: tuple[str, ...] = ()  # extra flags
    api_key: str | None = None  # sent by the load generator
    checkout: str | None = None  # run pdproxy from this directory (another git revision)

    def command(self, port: int, prefill: str, decode: str, logdir: str) -> list[str]:
        args = [a.replace("{logdir}", logdir) for a in self.args]
        command = proxy_args(port, prefill, decode, *args)
        if self.checkout is None:
            return command
        # From the checkout's directory: `python -m` puts the working directory first on
        # sys.path, so this process imports that revision's pdproxy, not the installed one.
        return ["env", "-C", self.checkout, f"PYTHONPATH={self.checkout}", *command]


def variant(spec: str) -> Variant:
    """``api-key``, ``access-log`` (logs at info: the access line of every request),
    ``flags=FLAGS`` (more pdproxy flags), or ``rev=REV`` (the same flags, the code of git
    revision REV, checked out aside)."""
    if spec == "api-key":
        return Variant("--api-key", ("--api-key-file", "{logdir}/client.key"), BENCH_KEY)
    if spec == "access-log":
        return Variant("logs at info", ("--log-level", "info"))
    if spec.startswith("flags="):
        return Variant(spec[6:], tuple(shlex.split(spec[6:])))
    if spec.startswith("rev="):
        return Variant(f"at {spec[4:]}", checkout=_checkout(spec[4:]))
    raise argparse.ArgumentTypeError("choose api-key, access-log, flags=FLAGS or rev=REV")


def _checkout(rev: str) -> str:
    """A detached worktree of ``rev`` in a temporary directory, removed at exit."""
    import atexit
    import subprocess

    path = tempfile.mkdtemp(prefix="pdproxy-rev-")
    subprocess.run(["git", "worktree", "add", "--detach", "-f", path, rev], check=True)
    atexit.register(subprocess.run, ["git", "worktree", "remove", "--force", path], check=False)
    return path


@contextlib.asynccontextmanager
async def sim_deployment(
    decode_tps: float, logdir: str, other: Variant | None = None
) -> AsyncIterator[Deployment]:
    """One prefill sim, one decode sim and pdproxy, each its own process; with ``other``,
    a second pdproxy in front of the same sims, configured as it says."""
    p_port, d_port, x_port, k_port = free_ports(4)
    p_url, d_url, x_url, k_url = (f"http://127.0.0.1:{p}" for p in (p_port, d_port, x_port, k_port))
    with contextlib.ExitStack() as stack:
        stack.enter_context(process(sim_args(p_port, "prefill", decode_tps), f"{logdir}/p.log"))
        stack.enter_context(process(sim_args(d_port, "decode", decode_tps), f"{logdir}/d.log"))
        proxy = stack.enter_context(process(proxy_args(x_port, p_url, d_url), f"{logdir}/x.log"))
        other_pid = 0
        if other is not None:
            await asyncio.to_thread(Path(f"{logdir}/client.key").write_text, BENCH_KEY)
            args = other.command(k_port, p_url, d_url, logdir)
            other_pid = stack.enter_context(process(args, f"{logdir}/k.log")).pid
        for url in (p_url, d_url, x_url, *([k_url] if other else [])):
            await wait_healthy(url)
        yield Deployment(d_url, x_url, proxy.pid, "sim-model", k_url if other else None, other_pid)


@contextlib.asynccontextmanager
async def real_deployment(logdir: str) -> AsyncIterator[Deployment]:
    """A real vLLM CPU prefill and decode (NIXL) and pdproxy; "direct" is the decode alone."""
    from engines.vllm.launch import vllm_engines

    with vllm_engines(connector="nixl") as pair:
        x_port = free_port()
        x_url = f"http://127.0.0.1:{x_port}"
        with process(
            proxy_args(x_port, pair.prefill_url, pair.decode_url), f"{logdir}/proxy.log"
        ) as proxy:
            await wait_healthy(x_url)
            yield Deployment(pair.decode_url, x_url, proxy.pid, pair.model)


async def measure(scenario: Scenario, logdir: str, other: Variant | None) -> dict[str, float]:
    deployment = (
        real_deployment(logdir)
        if scenario.real
        else sim_deployment(scenario.decode_tps, logdir, other)
    )
    async with deployment as d:
        decode_url, proxy_url, pid = d.decode_url, d.proxy_url, d.proxy_pid
        warm: dict[str, Any] = dict(
            concurrency=scenario.concurrency,
            max_tokens=scenario.max_tokens,
            model=d.model,
            unique_prompts=scenario.real,
        )
        warmup = 8 if scenario.real else 200
        await load.run(decode_url, total=warmup, **warm)
        await load.run(proxy_url, total=warmup, **warm)
        direct = await load.run(decode_url, total=scenario.total, **warm)
        cpu_before = cpu_seconds(pid)
        proxied = await load.run(proxy_url, total=scenario.total, **warm)
        cpu = cpu_seconds(pid) - cpu_before
        other_figures = await _other(d, other, scenario, warm, warmup, proxied.requests, cpu)
    return {
        **other_figures,
        "direct_rps": direct.rps,
        "proxied_rps": proxied.rps,
        "direct_p50": direct.ttft_p50_ms,
        "direct_p99": direct.ttft_ms(0.99),
        "proxied_p50": proxied.ttft_p50_ms,
        "proxied_p99": proxied.ttft_ms(0.99),
        "added_p50": proxied.ttft_p50_ms - direct.ttft_p50_ms,
        "cpu_ms": 1000 * cpu / max(proxied.requests, 1),
        "errors": direct.errors + proxied.errors,
    }


async def _other(
    d: Deployment,
    other: Variant | None,
    scenario: Scenario,
    warm: dict[str, Any],
    warmup: int,
    n: int,
    cpu: float,
) -> dict[str, float]:
    """The same load through the variant pdproxy, then once more through each,
    alternately, so both CPU figures come from the same run and machine state."""
    if d.variant_url is None or other is None:
        return {}
    key = other.api_key
    await load.run(d.variant_url, total=warmup, api_key=key, **warm)
    cpu_plain, cpu_other, n_plain, n_other = cpu, 0.0, n, 0
    for url, pid, is_other in (
        (d.variant_url, d.variant_pid, True),
        (d.proxy_url, d.proxy_pid, False),
        (d.variant_url, d.variant_pid, True),
    ):
        before = cpu_seconds(pid)
        result = await load.run(
            url, total=scenario.total, api_key=key if is_other else None, **warm
        )
        spent = cpu_seconds(pid) - before
        if is_other:
            cpu_other, n_other = cpu_other + spent, n_other + result.requests
        else:
            cpu_plain, n_plain = cpu_plain + spent, n_plain + result.requests
    plain_ms = 1000 * cpu_plain / max(n_plain, 1)
    other_ms = 1000 * cpu_other / max(n_other, 1)
    return {
        "cpu_plain_ms": plain_ms,
        "cpu_other_ms": other_ms,
        "other_cost": other_ms / plain_ms - 1,
    }


def variant_columns(other: Variant) -> tuple[tuple[str, str, str], ...]:
    return (
        ("CPU/request, plain", "cpu_plain_ms", "{:.3f} ms"),
        (f"CPU/request, {other.title}", "cpu_other_ms", "{:.3f} ms"),
        (f"{other.title}: cost", "other_cost", "{:+.1%}"),
    )


def verdict(scenario: Scenario, row: dict[str, float]) -> str:
    checks = []
    if scenario.target_cpu_ms is not None:
        ok = row["cpu_ms"] <= scenario.target_cpu_ms
        checks.append(f"CPU ≤ {scenario.target_cpu_ms} ms: {'met' if ok else 'MISSED'}")
    if scenario.target_added_ttft_ms is not None:
        ok = row["added_p50"] <= scenario.target_added_ttft_ms
        checks.append(
            f"added TTFT ≤ {scenario.target_added_ttft_ms} ms: {'met' if ok else 'MISSED'}"
        )
    return "; ".join(checks)


COLUMNS = (
    ("req/s direct", "direct_rps", "{:.0f}"),
    ("req/s proxied", "proxied_rps", "{:.0f}"),
    ("TTFT p50 direct", "direct_p50", "{:.2f} ms"),
    ("TTFT p50 proxied", "proxied_p50", "{:.2f} ms"),
    ("TTFT p99 direct", "direct_p99", "{:.2f} ms"),
    ("TTFT p99 proxied", "proxied_p99", "{:.2f} ms"),
    ("added TTFT p50", "added_p50", "{:+.2f} ms"),
    ("proxy CPU/request", "cpu_ms", "{:.3f} ms"),
    ("errors", "errors", "{:.0f}"),
)


def table(rows: list[tuple[Scenario, dict[str, float]]], other: Variant | None = None) -> str:
    columns = COLUMNS + (variant_columns(other) if other is not None else ())
    header = ["scenario", *(title for title, _, _ in columns), "target"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s, r in rows:
        cells = [s.name, *(_cell(fmt, r, key) for _, key, fmt in columns), verdict(s, r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(fmt: str, row: dict[str, float], key: str) -> str:
    return fmt.format(row[key]) if key in row else "—"


async def main_async(names: list[str] | None, other: Variant | None) -> None:
    rows = []
    with tempfile.TemporaryDirectory(prefix="pdproxy-bench-") as logdir:
        for scenario in SCENARIOS:
            if names and not any(scenario.name.startswith(f"({n})") for n in names):
                continue
            rows.append((scenario, await measure(scenario, logdir, other)))
            print(f"done: {scenario.name}", flush=True)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    print(f"\nmachine: {machine}\n")
    print(table(rows, other))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", nargs="*", help="scenario letters to run, e.g. a c")
    parser.add_argument(
        "--variant",
        type=variant,
        default=None,
        help="Also run each simulated scenario through a second pdproxy, alternating with "
        "the plain one in the same run, and report its CPU cost per request: api-key (checks "
        "a client key), access-log (logs at info: an access line per request), flags=FLAGS, "
        "rev=REV (the "
        "code of git revision REV, for a before/after in one run).",
    )
    parser.add_argument(
        "--api-key", action="store_true", help="Same as --variant api-key (kept for scripts)."
    )
    args = parser.parse_args()
    import uvloop

    other = variant("api-key") if args.api_key and args.variant is None else args.variant
    uvloop.run(main_async(args.only, other))


if __name__ == "__main__":
    main()
