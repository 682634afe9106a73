"""KV block bookkeeping: the block pool (for held blocks) and the prefix cache."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


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

    def __init__(self, capacity_blocks: int, block_size: int) -> None:
        self.capacity = capacity_blocks
        self.block_size = block_size
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def match_and_insert(self, kv: Sequence[bytes]) -> int:
        """Tokens served from cache (never the last prompt token), then cache all full blocks."""
        bs = self.block_size
        limit = (len(kv) - 1) // bs
        hits = 0
        while hits < limit and kv[(hits + 1) * bs - 1] in self._keys:
            self._keys.move_to_end(kv[(hits + 1) * bs - 1])
            hits += 1
        for b in range(hits, len(kv) // bs):
            self._keys[kv[(b + 1) * bs - 1]] = None
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)
        return hits * bs
