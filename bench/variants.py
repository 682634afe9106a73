"""`make bench --variant`: a second pdproxy in front of the same sims, configured otherwise
(quiet logs, a client key, other flags, another git revision), measured alternately with the
headline one (pdproxy's defaults) in the same run, so the CPU it costs comes from one
machine state. ``quiet`` (logs at warning: no access line) is the default."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import tempfile
from dataclasses import dataclass
from typing import Any

import aiohttp

from bench import load
from bench.deployment import Deployment
from bench.procs import proxy_args, tree_cpu_seconds

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


def variant(spec: str) -> Variant | None:
    """``quiet`` (logs at warning: no access line, the configuration of the figures before
    issue 24), ``api-key``, ``access-log`` (logs at info: the defaults' own, kept for
    scripts), ``flags=FLAGS`` (more pdproxy flags), ``rev=REV`` (the same flags, the code of
    git revision REV, checked out aside), or ``none`` (no second pdproxy)."""
    if spec == "none":
        return None
    if spec == "quiet":
        return Variant("quiet", ("--log-level", "warning"))
    if spec == "api-key":
        return Variant("--api-key", ("--api-key-file", "{logdir}/client.key"), BENCH_KEY)
    if spec == "access-log":
        return Variant("logs at info", ("--log-level", "info"))
    if spec.startswith("flags="):
        return Variant(spec[6:], tuple(shlex.split(spec[6:])))
    if spec.startswith("rev="):
        return Variant(f"at {spec[4:]}", checkout=checkout(spec[4:]))
    raise argparse.ArgumentTypeError(
        "choose quiet, api-key, access-log, flags=FLAGS, rev=REV or none"
    )


def checkout(rev: str) -> str:
    """A detached worktree of ``rev`` in a temporary directory, removed at exit."""
    import atexit
    import subprocess

    path = tempfile.mkdtemp(prefix="pdproxy-rev-")
    subprocess.run(["git", "worktree", "add", "--detach", "-f", path, rev], check=True)
    atexit.register(subprocess.run, ["git", "worktree", "remove", "--force", path], check=False)
    return path


async def alternate(
    d: Deployment,
    other: Variant | None,
    total: int,
    warm: dict[str, Any],
    warmup: int,
    n: int,
    cpu: float,
    direct: load.Result | None = None,
    session: aiohttp.ClientSession | None = None,
) -> dict[str, float]:
    """The same load through the variant pdproxy, then once more through each,
    alternately, so both CPU figures come from the same run and machine state. With
    ``direct`` (the direct path's measured rounds), the TTFT the variant adds too. As in
    the measured rounds, each pdproxy's client keeps its connections (``session``: the
    headline's) and a request per worker before each pass reopens any closed meanwhile."""
    if d.variant_url is None or other is None:
        return {}
    key = other.api_key
    async with load.client() as own, contextlib.AsyncExitStack() as stack:
        plain = session
        if plain is None:
            plain = await stack.enter_async_context(load.client())
        await load.run(d.variant_url, total=warmup, api_key=key, session=own, **warm)
        return await _passes(d, key, total, warm, (plain, own), n, cpu, direct)


async def _passes(
    d: Deployment,
    key: str | None,
    total: int,
    warm: dict[str, Any],
    sessions: tuple[aiohttp.ClientSession, aiohttp.ClientSession],
    n: int,
    cpu: float,
    direct: load.Result | None,
) -> dict[str, float]:
    cpu_plain, cpu_other, n_plain, n_other = cpu, 0.0, n, 0
    others: list[load.Result] = []
    assert d.variant_url is not None
    for url, pid, is_other in (
        (d.variant_url, d.variant_pid, True),
        (d.proxy_url, d.proxy_pid, False),
        (d.variant_url, d.variant_pid, True),
    ):
        shape = dict(api_key=key if is_other else None, session=sessions[is_other], **warm)
        await load.run(url, total=warm["concurrency"], **shape)
        before = tree_cpu_seconds(pid)
        result = await load.run(url, total=total, **shape)
        spent = tree_cpu_seconds(pid) - before
        if is_other:
            cpu_other, n_other = cpu_other + spent, n_other + result.requests
            others.append(result)
        else:
            cpu_plain, n_plain = cpu_plain + spent, n_plain + result.requests
    plain_ms = 1000 * cpu_plain / max(n_plain, 1)
    other_ms = 1000 * cpu_other / max(n_other, 1)
    out = {
        "cpu_plain_ms": plain_ms,
        "cpu_other_ms": other_ms,
        "other_cost": other_ms / plain_ms - 1,
    }
    if direct is not None and direct.ttft:
        pooled = load.merged(others)
        out["other_added_p50"] = pooled.ttft_p50_ms - direct.ttft_p50_ms
        out["other_added_p99"] = pooled.ttft_ms(0.99) - direct.ttft_ms(0.99)
    return out


def variant_columns(other: Variant) -> tuple[tuple[str, str, str], ...]:
    return (
        ("CPU/request, defaults", "cpu_plain_ms", "{:.3f} ms"),
        (f"CPU/request, {other.title}", "cpu_other_ms", "{:.3f} ms"),
        (f"{other.title}: cost", "other_cost", "{:+.1%}"),
        (f"added TTFT p50, {other.title}", "other_added_p50", "{:+.2f} ms"),
        (f"added TTFT p99, {other.title}", "other_added_p99", "{:+.2f} ms"),
    )
