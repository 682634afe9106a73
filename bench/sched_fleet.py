"""The scheduling benchmark's processes: a 4P4D sim fleet with per-engine speeds, and a pdproxy
started afresh for each policy in front of the same engines."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass

from bench.fleet import Sim, proxy_command
from bench.procs import process, wait_healthy
from engines.ports import free_ports


@dataclass
class TunedSim(Sim):
    """A fleet sim with flags of its own (speed, compute lanes, cache size)."""

    extra: tuple[str, ...] = ()

    def command(self) -> list[str]:
        return [*super().command(), *self.extra]


@dataclass(frozen=True)
class Shape:
    """How fast each engine is. Decodes prefill too when pdproxy sends them a request alone."""

    prefill_us_per_token: tuple[float, ...]  # one per prefill engine
    decode_us_per_token: float = 1000.0
    prefill_concurrency: int = 2  # compute lanes per engine (decodes too)
    decode_tps: float = 50.0
    prefix_cache_blocks: int = 8192
    extra: tuple[str, ...] = ()  # more flags for every sim (KV events, say)

    def flags(self, us_per_token: float) -> tuple[str, ...]:
        return (
            *("--prefill-us-per-token", str(us_per_token)),
            *("--prefill-concurrency", str(self.prefill_concurrency)),
            *("--prefix-cache-blocks", str(self.prefix_cache_blocks)),
            *self.extra,
        )


@dataclass(frozen=True)
class SimFleet:
    prefills: list[TunedSim]
    decodes: list[TunedSim]

    @property
    def sims(self) -> list[Sim]:
        return [*self.prefills, *self.decodes]


@contextlib.asynccontextmanager
async def sim_fleet(shape: Shape, decodes: int, logdir: str) -> AsyncIterator[SimFleet]:
    """Start the sims (prefills first), wait until all answer /health; stop them on exit."""
    engines = [("prefill", i, us) for i, us in enumerate(shape.prefill_us_per_token)]
    engines += [("decode", i, shape.decode_us_per_token) for i in range(decodes)]
    ports = free_ports(2 * len(engines))
    sims = [
        TunedSim(
            f"{role}-{i}",
            role,
            ports[2 * n],
            ports[2 * n + 1],
            shape.decode_tps,
            logdir,
            extra=shape.flags(us),
        )
        for n, (role, i, us) in enumerate(engines)
    ]
    with contextlib.ExitStack() as stack:
        for sim in sims:
            stack.callback(sim.stop)
            sim.start()
        for sim in sims:
            await wait_healthy(sim.url)
        k = len(shape.prefill_us_per_token)
        yield SimFleet(sims[:k], sims[k:])


@contextlib.asynccontextmanager
async def proxy(fleet: SimFleet, extra: list[str], log_path: str) -> AsyncIterator[str]:
    """pdproxy in front of the fleet with `extra` flags; yields its URL once it is healthy."""
    (port,) = free_ports(1)
    with process(proxy_command(port, fleet.sims, extra), log_path):
        url = f"http://127.0.0.1:{port}"
        await wait_healthy(url)
        yield url


def proxy_help() -> str:
    """pdproxy's --help text, to see which scheduling flags this build has.

    A pdproxy that does not start (say, mid-edit) is an error, not a build without flags.
    """
    args = [sys.executable, "-m", "pdproxy", "--help"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    if done.returncode != 0 or "--prefill" not in done.stdout:
        raise RuntimeError(f"pdproxy --help failed: {done.stderr.strip()[-500:]}")
    return done.stdout
