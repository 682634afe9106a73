"""A decode's prediction, checked against its own events. Pure.

vLLM's answers report a prefill's cache hit, never a decode's: a decode's
``cached_tokens`` is the prefill's (``remote_prefill_cached_tokens``, vLLM 0.32), and its
own hit is not in the answer. But an engine stores, and publishes, exactly the blocks of a
prompt it did not hold: the received ones, from its local hit on (vLLM's
``cache_full_blocks`` from ``num_cached_blocks``; the sim does the same). So the position
in the prompt of the first block a decode stores after a leg is its hit, in blocks, and is
checked against the index's prediction (``kv_check``), as a prefill's is against its answer.

``AwaitedStores`` keeps, per engine rank, some prompt keys of legs whose prediction waits
for that first store: the block predicted to be stored first, the ``WINDOW`` blocks before
it, and the first block. A store starting at the predicted block is right; one starting
before it (the window, or the whole prompt: a publisher that lied, removals that were
lost) is a block or more over it, and wrong. A store starting elsewhere is not checked, nor
is a decode that held more than predicted (it stores past them; the staleness clock still
catches events that stopped) or the whole prompt (it stores none of it). So a decision
costs a few microseconds whatever the prompt. At most ``max_keys`` keys per rank (the
oldest legs go first) and ``seconds`` per leg; when two legs share blocks, the later one's
prediction is checked.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

WINDOW = 15  # blocks before the predicted first store that are looked for


@dataclass(slots=True, eq=False)
class _Leg:
    predicted: int  # whole blocks
    keys: tuple[int, ...]  # the ones looked for: the first block, then from ``start`` on
    start: int  # the prompt position of ``keys[1]`` (1: no gap)
    until: float  # monotonic
    done: bool = False  # checked, expired or dropped: its keys are skipped

    def position(self, key: int) -> int:
        """The prompt position of one of ``keys``."""
        i = self.keys.index(key)
        return i if i == 0 else self.start + i - 1


class AwaitedStores:
    def __init__(self, *, seconds: float = 30.0, max_keys: int = 65536) -> None:
        self.seconds = seconds
        self.max_keys = max_keys
        # rank -> key -> leg: a done leg's keys are left behind (skipped when found), and
        # dropped when the map is rebuilt past ``max_keys``, at C speed
        self._by_key: dict[str, dict[int, _Leg]] = {}
        self._legs: dict[str, deque[_Leg]] = {}  # rank -> its legs, oldest first

    def add(self, name: str, keys: tuple[int, ...], predicted: int, now: float) -> None:
        """A decode leg was sent to ``name`` for a prompt of ``keys``, ``predicted`` of its
        whole blocks cached there (``keys[predicted]`` is the block it should store first)."""
        if predicted >= len(keys):
            return  # it should store none of the prompt: nothing to check
        start = max(predicted - WINDOW, 1)
        looked = keys[:1] + keys[start : predicted + 1] if start > 1 else keys[: predicted + 1]
        leg = _Leg(predicted, looked, start, now + self.seconds)
        by_key = self._by_key.get(name)
        if by_key is None:
            by_key = self._by_key[name] = {}
            self._legs[name] = deque()
        by_key.update(dict.fromkeys(looked, leg))  # C loops: a decision's cost stays small
        legs = self._legs[name]
        legs.append(leg)
        if len(by_key) > self.max_keys or len(legs) > self.max_keys:
            self._rebuild(name, legs)

    def stored(self, name: str, keys: list[int]) -> tuple[int, int] | None:
        """``name`` stored blocks ``keys`` (in order, one request's chain): (predicted, hit)
        in blocks, of the leg whose looked-for blocks hold the first of them, then done.
        (Keys chain their whole prefix: a prompt's later block is never stored without the
        blocks between.)"""
        by_key = self._by_key.get(name)
        leg = by_key.get(keys[0]) if by_key and keys else None
        if leg is None or leg.done:
            return None
        leg.done = True
        return leg.predicted, leg.position(keys[0])

    def sweep(self, now: float) -> None:
        """Legs past their time are no longer checked."""
        for legs in self._legs.values():
            while legs and (legs[0].done or legs[0].until < now):
                legs.popleft().done = True

    def forget(self, name: str) -> None:
        self._by_key.pop(name, None)
        self._legs.pop(name, None)

    def waiting(self, name: str) -> int:
        """Legs of ``name`` still waiting for their first store."""
        return sum(not leg.done for leg in self._legs.get(name, ()))

    def _rebuild(self, name: str, legs: deque[_Leg]) -> None:
        """Past ``max_keys``: the oldest legs go until the live ones hold at most half of
        it, and the map keeps only theirs (amortised: one rebuild a half-cap of adds)."""
        live = sum(len(leg.keys) for leg in legs if not leg.done)
        while len(legs) > 1 and (legs[0].done or live > self.max_keys // 2):
            leg = legs.popleft()
            if not leg.done:
                live -= len(leg.keys)
                leg.done = True
        self._by_key[name] = {key: leg for key, leg in self._by_key[name].items() if not leg.done}
