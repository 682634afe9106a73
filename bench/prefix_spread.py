"""Offline: the prefill hit rate on a multi-tenant workload whose tenants do not all fit in
the caches: ``prefix-affinity`` with its old tie-break (least loaded), with new prefixes
spread, ``kv-events`` fed by the caches' own events, and an oracle that reads every cache.

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
from pdproxy.scheduling.kv_events import Event, KVIndex, Removed, Stored
from pdproxy.scheduling.kv_keys import instance_name
from pdproxy.scheduling.pickers import MaxScorePicker
from pdproxy.scheduling.policies import RolePolicy, build_policy
from pdproxy.types import Endpoint, EngineAddress, Role, Source

TENANTS = 24
BLOCK = 16
PREFIX_BLOCKS = 32  # 512 tokens of 16-token blocks
SUFFIX_BLOCKS = 4
CACHE_BLOCKS = 5 * (PREFIX_BLOCKS + SUFFIX_BLOCKS)  # about five tenants per prefill
PREFILLS = 4
REQUESTS = 4000


Block = tuple[int, int]


def tokens_of(block: Block) -> list[int]:
    return [hash((block, i)) & 0xFFFF for i in range(BLOCK)]


class Cache:
    """An engine's prefix cache (LRU blocks) that publishes what it stores and evicts into
    ``index`` under ``name``, as vLLM's events would (in order, none lost)."""

    def __init__(self, capacity: int, index: KVIndex, name: str) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[Block, None] = OrderedDict()
        self.index, self.name = index, name
        index.follow(name)

    def hit(self, blocks: list[Block]) -> int:
        hit = 0
        for block in blocks:
            if block not in self.blocks:
                break
            hit += 1
        return hit

    def serve(self, blocks: list[Block]) -> int:
        hit = self.hit(blocks)
        events: list[Event] = []
        parent = None
        for block in blocks:
            if block not in self.blocks:
                events.append(Stored((hash(block),), parent, tokens_of(block), BLOCK))
            self.blocks[block] = None
            self.blocks.move_to_end(block)
            parent = hash(block)
        while len(self.blocks) > self.capacity:
            events.append(Removed((hash(self.blocks.popitem(last=False)[0]),)))
        self.index.apply(self.name, events)
        return hit


def run(mode: str, seed: int = 7) -> float:
    rng = random.Random(seed)
    index = KVIndex(1_000_000)
    name = "kv-events" if mode in ("kv-events", "oracle") else "prefix-affinity"
    policy = build_policy(name, SchedulingConfig(), random.Random(seed), index)
    if mode == "before":  # the old tie-break: the least loaded, that is the fastest when idle
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
    caches = {e.url: Cache(CACHE_BLOCKS, index, instance_name(e.url, 0)) for e in prefills}
    hits = total = 0
    for n in range(REQUESTS):
        tenant = rng.randrange(TENANTS)
        blocks = [(tenant, b) for b in range(PREFIX_BLOCKS)]
        blocks += [(-1, n * SUFFIX_BLOCKS + b) for b in range(SUFFIX_BLOCKS)]
        if rng.random() < 0.25:  # another client, straight to an engine
            caches[rng.choice(prefills).url].serve(blocks)
            continue
        ids = [t for block in blocks for t in tokens_of(block)]
        features = RequestFeatures(tokens=len(ids), blocks=tuple(map(hash, blocks)), token_ids=ids)
        if mode == "oracle":  # the longest cached prefix anywhere (ties: the policy)
            best = max(caches[e.url].hit(blocks) for e in prefills)
            top = [e for e in prefills if caches[e.url].hit(blocks) == best]
            chosen = top[0] if len(top) == 1 else policy.choose(Context(features, 0.0, 3.0), top)
        else:
            chosen = policy.choose(Context(features, 0.0, 3.0), prefills)
        hits += caches[chosen.url].serve(blocks)
        total += len(blocks)
    return hits / total


MODES = ("before", "spread", "kv-events", "oracle")


def main() -> None:
    print("prefill hit rate  " + "  ".join(f"{m:>10}" for m in MODES))
    for seed in (1, 2, 3):
        print(f"seed {seed}           " + "  ".join(f"{run(m, seed):10.3f}" for m in MODES))


if __name__ == "__main__":
    main()
