"""Offline: the prefill hit rate of ``prefix-affinity`` on a multi-tenant workload whose
tenants do not all fit in the caches, with and without spreading unmatched prompts.

A model, not a fleet: the real policy (``build_policy``) chooses among real ``Endpoint``
records; each prefill is an LRU cache of whole blocks; requests finish before the next
arrives (low load: the case where the tie-break decides), and one prefill is measured
faster than the others (slowness 0.8 against 1.1). A quarter of the requests come from
another client straight to a random engine (the proxy never hears of them).
Run: ``python -m bench.prefix_spread``.
"""

from __future__ import annotations

import random
from collections import OrderedDict

from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.scheduling.context import Context, RequestFeatures
from pdproxy.scheduling.pickers import MaxScorePicker
from pdproxy.scheduling.policies import RolePolicy, build_policy
from pdproxy.types import Endpoint, EngineAddress, Role, Source

TENANTS = 24
PREFIX_BLOCKS = 32  # 512 tokens of 16-token blocks
SUFFIX_BLOCKS = 4
CACHE_BLOCKS = 5 * (PREFIX_BLOCKS + SUFFIX_BLOCKS)  # about five tenants per prefill
PREFILLS = 4
REQUESTS = 4000


class Cache:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[tuple[int, int], None] = OrderedDict()

    def serve(self, blocks: list[tuple[int, int]]) -> int:
        hit = 0
        for block in blocks:
            if block not in self.blocks:
                break
            hit += 1
        for block in blocks:
            self.blocks[block] = None
            self.blocks.move_to_end(block)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        return hit


def run(spread: bool, seed: int = 7) -> float:
    rng = random.Random(seed)
    policy = build_policy("prefix-affinity", SchedulingConfig(), random.Random(seed))
    if not spread:  # today's tie-break: the least loaded, that is the fastest when idle
        policy = RolePolicy(
            policy.name,
            policy.filters,
            policy.scorers,
            MaxScorePicker(random.Random(seed), by_load=True),
            policy.index,
        )
    prefills = [
        Endpoint.new(
            role=Role.PREFILL, address=EngineAddress(url=f"http://p{i}:1"), source=Source.STATIC
        )
        for i in range(PREFILLS)
    ]
    for i, e in enumerate(prefills):
        e.speed.slowness = 0.8 if i == 0 else 1.1
    caches = {e.url: Cache(CACHE_BLOCKS) for e in prefills}
    hits = total = 0
    for n in range(REQUESTS):
        tenant = rng.randrange(TENANTS)
        blocks = [(tenant, b) for b in range(PREFIX_BLOCKS)]
        blocks += [(-1, n * SUFFIX_BLOCKS + b) for b in range(SUFFIX_BLOCKS)]
        if rng.random() < 0.25:  # another client, straight to an engine
            caches[rng.choice(prefills).url].serve(blocks)
            continue
        features = RequestFeatures(tokens=16.0 * len(blocks), blocks=tuple(map(hash, blocks)))
        chosen = policy.choose(Context(features, 0.0, 3.0), prefills)
        hits += caches[chosen.url].serve(blocks)
        total += len(blocks)
    return hits / total


def main() -> None:
    for seed in (1, 2, 3):
        before, after = run(False, seed), run(True, seed)
        print(f"seed {seed}: least-loaded tie-break {before:.3f}, spread {after:.3f}")


if __name__ == "__main__":
    main()
