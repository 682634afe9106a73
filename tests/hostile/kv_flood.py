"""``python -m tests.hostile.kv_flood PORT SECONDS [clears|garbage]``: a hostile engine's
KV-event publisher.

Binds vLLM's PUB socket on 127.0.0.1:PORT, prints ``ready``, then for SECONDS publishes
batches just under pdproxy's bound on a batch (``kv_subscriber._MAX_BYTES``) made of
one-token blocks (the most blocks a byte can carry: about 180,000 a batch, each a new
chain from the root, so the index fills and evicts), and every third batch one over the
bound. With ``clears``: one batch that fills the index, then every ``PERIOD`` a batch of ten
``AllBlocksCleared`` (a 100-odd-byte batch; before issue 29 each clear walked the whole
index) followed by the fill again. With ``garbage``: batches of tens of bytes whose
one event cannot be applied, or whose payload is not msgpack, as fast as ZMQ takes them
(before issue 29 each of the first logged a whole traceback). Then one JSON line: the
batches sent. A process of its own, so packing them never counts in the test's figures.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
import time

from engines.sim.kv_events import KVEventPublisher, cleared, stored
from pdproxy.membership.kv_subscriber import _MAX_BYTES

BYTES_A_BLOCK = 10  # a 9-byte hash and a 1-byte token id
PERIOD = 1.0  # seconds between two batches


def _batch(first_hash: int, blocks: int) -> list[object]:
    hashes = range(first_hash, first_hash + blocks)
    return [stored(hashes, None, [i % 100 for i in range(blocks)], 1, "map")]


async def main(port: int, seconds: float) -> None:
    publisher = KVEventPublisher(f"tcp://127.0.0.1:{port}", buffer_steps=1)
    under = int(_MAX_BYTES * 0.85) // BYTES_A_BLOCK
    over = int(_MAX_BYTES * 1.25) // BYTES_A_BLOCK
    hashes = itertools.count(1 << 60, 1 << 20)
    sent = {"under": 0, "over": 0}
    print("ready", flush=True)
    deadline = time.monotonic() + seconds
    for n in itertools.count():
        if time.monotonic() >= deadline:
            break
        kind = "over" if n % 3 == 2 else "under"
        publisher.publish(_batch(next(hashes), over if kind == "over" else under))
        sent[kind] += 1
        await asyncio.sleep(PERIOD)
    print(json.dumps(sent), flush=True)
    await publisher.aclose()


async def clears(port: int, seconds: float) -> None:
    publisher = KVEventPublisher(f"tcp://127.0.0.1:{port}", buffer_steps=1)
    fill = int(_MAX_BYTES * 0.85) // BYTES_A_BLOCK
    hashes = itertools.count(1 << 60, 1 << 20)
    sent = {"fills": 0, "clears": 0}
    print("ready", flush=True)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        publisher.publish(_batch(next(hashes), fill))
        sent["fills"] += 1
        await asyncio.sleep(PERIOD)
        publisher.publish([cleared("map")] * 10)
        sent["clears"] += 1
    print(json.dumps(sent), flush=True)
    await publisher.aclose()


async def garbage(port: int, seconds: float) -> None:
    publisher = KVEventPublisher(f"tcp://127.0.0.1:{port}", buffer_steps=1)
    # an event that decodes but cannot be applied: extra keys that cannot be hashed (before
    # issue 29, a traceback each), and an unhashable LoRA name
    fields = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None}
    fields |= {"token_ids": [1], "block_size": 1}
    bad = [{**fields, "extra_keys": [[[1]]]}, {**fields, "lora_name": [1]}]
    sent = {"garbage": 0}
    print("ready", flush=True)
    await asyncio.sleep(0.5)  # past ZMQ's slow joiner
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for n in range(100):  # events that cannot be applied, then a payload not msgpack
            if n % 2:
                publisher.publish([bad[n % 4 // 2]])
            else:
                publisher.publish_raw(b"\xc1" * 24)
        sent["garbage"] += 100
        await asyncio.sleep(0.01)
    print(json.dumps(sent), flush=True)
    await publisher.aclose()


if __name__ == "__main__":
    run = {"clears": clears, "garbage": garbage}.get(sys.argv[3] if sys.argv[3:] else "", main)
    asyncio.run(run(int(sys.argv[1]), float(sys.argv[2])))
