"""KV block bookkeeping: the block pool (for held blocks) and the prefix cache."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from engines.sim import kv_events

# A sink for one batch of KV events (engines/sim/kv_events.py builds them).
EventSink = Callable[[list[Any]], None]


class BlockPool:
    """Block ids 0..num_blocks-1; `used` feeds vllm:kv_cache_usage_perc."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.pop() for _ in range(n)]

    def free(self, ids: Sequence[int]) -> None:
        self._free.extend(reversed(ids))


class PrefixCache:
    """Full blocks seen before, keyed by the KV entry of their last token (it chains the prefix)."""

    def __init__(
        self, capacity_blocks: int, block_size: int, events: KVEvents | None = None
    ) -> None:
        self.capacity = capacity_blocks
        self.block_size = block_size
        self._keys: OrderedDict[bytes, None] = OrderedDict()
        self.events = events  # None: no --kv-events-endpoint, nothing built per request

    def match_and_insert(self, kv: Sequence[bytes], tokens: Sequence[int] = ()) -> int:
        """Tokens served from cache (never the last prompt token), then cache all full blocks
        (and, with ``events``, publish what was stored and evicted, as vLLM does)."""
        bs = self.block_size
        limit = (len(kv) - 1) // bs
        hits = 0
        while hits < limit and kv[(hits + 1) * bs - 1] in self._keys:
            self._keys.move_to_end(kv[(hits + 1) * bs - 1])
            hits += 1
        new = [kv[(b + 1) * bs - 1] for b in range(hits, len(kv) // bs)]
        for key in new:
            self._keys[key] = None
        evicted = []
        while len(self._keys) > self.capacity:
            evicted.append(self._keys.popitem(last=False)[0])
        if self.events is not None:
            parent = kv[hits * bs - 1] if hits else None
            self.events.changed(new, parent, tokens[hits * bs : (hits + len(new)) * bs], evicted)
        return hits * bs


class KVEvents:
    """The prefix cache's changes as vLLM's events: engine hashes are the first 8 bytes
    of a block's key as an int (vLLM publishes 64-bit ints by default)."""

    def __init__(self, block_size: int, encoding: str, sink: EventSink) -> None:
        self.block_size = block_size
        self.encoding = encoding
        self.sink = sink

    def changed(
        self,
        stored: Sequence[bytes],
        parent: bytes | None,
        tokens: Sequence[int],
        evicted: Sequence[bytes],
    ) -> None:
        events: list[Any] = []
        if stored and len(tokens) == len(stored) * self.block_size:
            hashes = [_engine_hash(k) for k in stored]
            top = None if parent is None else _engine_hash(parent)
            events.append(kv_events.stored(hashes, top, tokens, self.block_size, self.encoding))
        if evicted:
            events.append(kv_events.removed([_engine_hash(k) for k in evicted], self.encoding))
        if events:
            self.sink(events)


def _engine_hash(key: bytes) -> int:
    return int.from_bytes(key[:8], "big")
