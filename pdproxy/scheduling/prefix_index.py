"""An approximate, bounded index of which instances hold which prompt prefixes.

Each entry maps a chained block hash (``features.block_hashes``) to the set of
instances, as a bit mask, that were sent a prompt with that prefix. Entries live in LRU
order and the index never holds more than ``max_blocks`` of them: an unbounded prefix
tree is how a router runs out of memory (production-stack #687). An instance that leaves
is forgotten at once (its bit is cleared everywhere; emptied entries go), and its bit is
then reused.

It is approximate by design: the engines evict their own caches, and a restarted engine
has none. A wrong guess costs a cache miss, never a wrong answer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class PrefixIndex:
    """Two kinds live in a process, each with one owner:

    * a policy's approximate index (``prefix-affinity``, and ``kv-events`` for the
      instances without live events), owned by its ``RolePolicy`` (``RolePolicy.index``)
      and read by its ``PrefixScorer`` and the scheduler's decider; fed from two places in
      ``scheduling``: each pick of its policy (``RolePolicy.choose``: ``insert``) and an
      instance's removal from the registry (``Scheduler.forget``: ``forget``, the
      registry's ``on_removal`` listener wired by ``pdproxy.build``);
    * the exact index inside a ``KVIndex`` (``KVIndex.prefixes``), fed by that
      ``KVIndex`` alone (``insert``, ``remove``, ``release``) from the engines' events."""

    def __init__(self, max_blocks: int) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.max_blocks = max_blocks
        self._entries: OrderedDict[int, int] = OrderedDict()
        self._bits: dict[str, int] = {}  # url -> bit
        self._free: list[int] = []
        self._next_bit = 0

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, blocks: tuple[int, ...]) -> dict[str, int]:
        """For every instance holding at least the first block: how many leading blocks of
        ``blocks`` it holds."""
        depths: dict[str, int] = {}
        if not blocks or not self._entries:
            return depths
        entries = self._entries
        alive = entries.get(blocks[0], 0)
        if not alive:  # nobody holds even the first block: no need to walk the rest
            return depths
        depth = 0
        for block in blocks:
            still = alive & entries.get(block, 0)
            if still != alive:
                self._record(alive & ~still, depth, depths)
                alive = still
                if not alive:
                    break
            depth += 1
        if alive:
            self._record(alive, depth, depths)
        return depths

    def _record(self, mask: int, depth: int, into: dict[str, int]) -> None:
        if depth == 0:
            return
        for url, bit in self._bits.items():
            if mask >> bit & 1:
                into[url] = depth

    def insert(self, blocks: Iterable[int], url: str) -> None:
        """Remember that ``url`` now holds the prefix ``blocks``."""
        bit = 1 << self._bit(url)
        entries = self._entries
        refresh = entries.move_to_end
        for block in blocks:
            mask = entries.get(block)
            if mask is None:
                entries[block] = bit  # new: most recently used
                continue
            if not mask & bit:
                entries[block] = mask | bit
            refresh(block)
        while len(entries) > self.max_blocks:
            entries.popitem(last=False)

    def remove(self, blocks: Iterable[int], url: str) -> None:
        """``url`` no longer holds ``blocks`` (its engine evicted them); an entry nobody
        holds goes."""
        bit = self._bits.get(url)
        if bit is None:
            return
        keep = ~(1 << bit)
        entries = self._entries
        for block in blocks:
            mask = entries.get(block)
            if mask is None:
                continue
            mask &= keep
            if mask:
                entries[block] = mask
            else:
                del entries[block]

    def forget(self, url: str) -> None:
        """``url`` left the fleet: clear it everywhere and free its bit."""
        bit = self._bits.pop(url, None)
        if bit is None:
            return
        keep = ~(1 << bit)
        entries = self._entries
        for block, mask in list(entries.items()):
            mask &= keep
            if mask:
                entries[block] = mask
            else:
                del entries[block]
        self._free.append(bit)

    def release(self, url: str) -> None:
        """Free ``url``'s bit without a walk: its caller removed every entry it holds
        (``KVIndex`` keeps them all in its own map, so a leaving engine costs what it
        held, not the whole index)."""
        bit = self._bits.pop(url, None)
        if bit is not None:
            self._free.append(bit)

    def instances(self) -> list[str]:
        return list(self._bits)

    def _bit(self, url: str) -> int:
        bit = self._bits.get(url)
        if bit is None:
            if self._free:
                bit = self._free.pop()
            else:
                bit = self._next_bit
                self._next_bit += 1
            self._bits[url] = bit
        return bit
