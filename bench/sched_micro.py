"""Scheduling micro-benchmark (part of `make bench`): what one decision costs with 64
instances (32 prefills + 32 decodes) for every policy, and the prefix index size and
memory after 1,000,000 distinct prompts. Pure CPU, no I/O, timed in process CPU time
(other processes on the machine do not inflate it): the scheduler's own cost, apart
from the request's HTTP path that `bench.run` measures.

    python -m bench.sched_micro [--instances 64] [--decisions 20000] [--prompts 1000000]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import tracemalloc
from typing import Any

from pdproxy.config.scheduling import POLICIES, SchedulingConfig
from pdproxy.scheduling.prefix_index import PrefixIndex
from pdproxy.scheduling.scheduler import Scheduler
from pdproxy.types import Endpoint, EngineAddress, EngineLoad, Role, Snapshot, Source

TARGET_US = 20.0
_ROUNDS = 5
NOW = 1000.0


def _fleet(instances: int, rng: random.Random) -> Snapshot:
    def one(i: int, role: Role) -> Endpoint:
        e = Endpoint.new(
            role=role,
            address=EngineAddress(url=f"http://10.0.{i // 250}.{i % 250}:8000"),
            source=Source.STATIC,
        )
        e.legs.in_flight = rng.randrange(8)
        e.legs.work = float(e.legs.in_flight)
        e.load.engine_load = EngineLoad(rng.randrange(8), rng.randrange(4), rng.random(), NOW)
        e.load.others, e.load.others_until = e.load.engine_load.others, NOW + 3.0
        return e

    half = instances // 2
    return Snapshot(
        tuple(one(i, Role.PREFILL) for i in range(half)),
        tuple(one(half + i, Role.DECODE) for i in range(instances - half)),
    )


def _bodies(n: int, rng: random.Random) -> list[dict[str, Any]]:
    """Chat requests over 8 system prompts, 1-2 KB each, with a session key."""
    systems = [f"You are assistant {k}. " + "Follow the house rules. " * 40 for k in range(8)]
    return [
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": rng.choice(systems)},
                {"role": "user", "content": f"question {i}: " + "tell me more " * 10},
            ],
            "user": f"user-{i % 500}",
        }
        for i in range(n)
    ]


def decision_costs(instances: int, decisions: int) -> list[tuple[str, str, float, float]]:
    """(prefill policy, decode policy, µs per decision, µs per feature extraction), each
    the best of ``_ROUNDS`` rounds (timeit's rule: the minimum is the cost without the
    interference of whatever else the machine runs)."""
    rng = random.Random(7)
    snapshot, bodies = _fleet(instances, rng), _bodies(decisions, rng)
    combos = [(p, p) for p in POLICIES]
    defaults = SchedulingConfig()
    combos.insert(0, (defaults.prefill_policy, defaults.decode_policy))
    rows = []
    for prefill, decode in combos:
        config = SchedulingConfig(prefill_policy=prefill, decode_policy=decode)
        s = Scheduler(config, clock=lambda: NOW, rng=random.Random(1), max_age=3.0)
        extract, decide = [], []
        for _ in range(_ROUNDS):
            started = time.process_time()
            features = [s.features(b, None) for b in bodies]
            extract.append((time.process_time() - started) / decisions * 1e6)
            started = time.process_time()
            for f in features:
                s.schedule(f, snapshot)
            decide.append((time.process_time() - started) / decisions * 1e6)
        rows.append((prefill, decode, min(decide), min(extract)))
    return rows


def index_under_load(prompts: int, cap: int) -> tuple[int, float, float]:
    """Insert ``prompts`` distinct 4-block prompts over 32 instances: (entries kept,
    MiB held, µs per insert)."""
    tracemalloc.start()
    index = PrefixIndex(cap)
    urls = [f"http://10.0.0.{i}:8000" for i in range(32)]
    started = time.process_time()
    for i in range(prompts):
        base = i * 4
        index.insert((base, base + 1, base + 2, base + 3), urls[i % 32])
    elapsed = time.process_time() - started
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return len(index), held / 2**20, elapsed / prompts * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--instances", type=int, default=64)
    p.add_argument("--decisions", type=int, default=5000, help="per round (5 rounds)")
    p.add_argument("--prompts", type=int, default=1_000_000)
    a = p.parse_args(argv)
    cap = SchedulingConfig().prefix_index_max_blocks
    print(f"\n## Scheduling decision, {a.instances} instances ({a.decisions} decisions)\n")
    print("| prefill policy | decode policy | µs per decision | µs to extract features |")
    print("|---|---|---:|---:|")
    worst_default = 0.0
    for i, (prefill, decode, us, extract) in enumerate(decision_costs(a.instances, a.decisions)):
        name = f"{prefill} (default)" if i == 0 else prefill
        print(f"| {name} | {decode} | {us:.1f} | {extract:.1f} |")
        worst_default = us if i == 0 else worst_default
    kept, mib, insert_us = index_under_load(a.prompts, cap)
    print(
        f"\nPrefix index after {a.prompts:,} distinct prompts: {kept:,} blocks kept (cap"
        f" {cap:,}), {mib:.1f} MiB, {insert_us:.2f} µs per insert."
    )
    ok = worst_default <= TARGET_US and kept <= cap
    print(
        f"Default policies: {worst_default:.1f} µs per decision (target ≤ {TARGET_US:.0f} µs)"
        f" {'OK' if ok else 'OVER'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
