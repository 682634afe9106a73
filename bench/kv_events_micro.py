"""The kv-events policy's cost per decision at 64 instances and ~100k indexed blocks (the
prefill leg's, which adds the cost in tokens to the decode leg's blocks held), against
prefix-affinity's, and the index's own costs, in process CPU time (part of `make bench`).
Run: ``python -m bench.kv_events_micro``."""

from __future__ import annotations

import random
import time
import timeit

from engines.sim.kv_events import stored
from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.scheduling.context import Context, RequestFeatures
from pdproxy.scheduling.kv_events import KVIndex, decode_batch
from pdproxy.scheduling.kv_keys import block_keys, instance_name
from pdproxy.scheduling.policies import RolePolicy, build_policy
from pdproxy.types import Endpoint, EngineAddress, Role, Source

INSTANCES, PREFIXES, BLOCKS, BLOCK = 64, 25, 62, 16  # 64 x 25 x 62 = 99,200 blocks


def main() -> None:
    rng = random.Random(1)
    index = KVIndex(100_000)
    endpoints = [
        Endpoint.new(
            role=Role.PREFILL, address=EngineAddress(url=f"http://e{i}:1"), source=Source.STATIC
        )
        for i in range(INSTANCES)
    ]
    held = []
    for e in endpoints:
        name = instance_name(e.url, 0)
        index.follow(name)
        for p in range(PREFIXES):
            tokens = [rng.randrange(50_000) for _ in range(BLOCK * BLOCKS)]
            held.append(tokens)
            hashes = list(range(p * 100, p * 100 + BLOCKS))
            event = stored(hashes, None, tokens, BLOCK, "map")
            index.apply(name, decode_batch([0.0, [event], 0])[0])
    config = SchedulingConfig(prefix_index_max_blocks=100_000)
    kv = build_policy("kv-events", config, random.Random(0), index, Role.PREFILL)  # the cost
    kv_decode = build_policy("kv-events", config, random.Random(0), index, Role.DECODE)
    approximate = build_policy("prefix-affinity", config, random.Random(0))
    hit = held[5 * PREFIXES] + [1] * 100
    miss = [rng.randrange(50_000) for _ in range(len(hit))]

    def decide(policy: RolePolicy, ids: list[int]) -> None:
        features = RequestFeatures(tokens=float(len(ids)), token_ids=ids, blocks=(hash(ids[0]),))
        policy.choose(Context(features, 0.0, 3.0), endpoints)

    def per_call(fn, n: int = 2000) -> float:
        """µs per call in process CPU time (other processes on the machine do not inflate
        it), the best of three rounds, as bench.sched_micro times."""
        return min(timeit.repeat(fn, number=n, repeat=3, timer=time.process_time)) / n * 1e6

    print(f"indexed blocks: {len(index)}, instances: {INSTANCES}, prompt: {len(hit)} tokens")
    print(f"kv-events decision, hit:        {per_call(lambda: decide(kv, hit)):7.1f} us")
    print(f"kv-events decision, miss:       {per_call(lambda: decide(kv, miss)):7.1f} us")
    print(f"kv-events decode leg, hit:      {per_call(lambda: decide(kv_decode, hit)):7.1f} us")
    print(f"prefix-affinity decision:       {per_call(lambda: decide(approximate, hit)):7.1f} us")
    print(f"block_keys of the prompt:       {per_call(lambda: block_keys(hit, BLOCK)):7.1f} us")
    event = decode_batch(
        [0.0, [stored(list(range(10**6, 10**6 + 32)), None, hit[:512], BLOCK, "map")], 0]
    )[0]
    apply = per_call(lambda: index.apply("x|0", event), 500)
    print(f"apply a 32-block BlockStored:   {apply:7.1f} us")


if __name__ == "__main__":
    main()
