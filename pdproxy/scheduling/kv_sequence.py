"""Sequence numbers of one KV-event publisher: what to do with each batch. Pure.

vLLM numbers each batch from 0 per engine process (``ZmqEventPublisher``), so:

* the next number: apply it;
* a number past the next (batches were lost, the PUB socket drops when a subscriber is
  slow or reconnects): keep the batch aside and ask the replay socket from the next one;
* a number at or below the last with a newer timestamp (a new engine counting from 0
  again, which may equal the last number of an engine that published once): the engine
  restarted; what the index holds for it is stale: clear it and rebuild from a replay
  from 0. With a timestamp no newer than the last applied batch's, it is a batch already
  applied (the SUB socket queued it while the replay answered it): skipped;
* a replay that does not start where it was asked (the buffer no longer holds it): the gap
  cannot be filled; clear and rebuild from what the replay holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Action(Enum):
    APPLY = "apply"
    SKIP = "skip"  # already applied (a replay overlapping what was seen)
    REPLAY = "replay"  # a gap: ask for the missing batches from ``SequenceTracker.next``
    # clear the engine's entries; then, live: replay from 0; replayed: apply this batch
    RESTART = "restart"


@dataclass(slots=True)
class SequenceTracker:
    next: int | None = None  # the number expected next; None before the first batch
    last_ts: float = float("-inf")  # the engine's timestamp of the last applied batch
    gaps: int = 0
    restarts: int = 0

    def live(self, seq: int, ts: float) -> Action:
        """A batch from the PUB socket, numbered ``seq``, stamped ``ts`` by the engine."""
        expected = self.next
        if expected is None or seq == expected:
            return self._apply(seq, ts)
        if seq > expected:
            self.gaps += 1
            return Action.REPLAY
        if ts <= self.last_ts:
            return Action.SKIP
        self.restarts += 1
        self.reset()
        return Action.RESTART

    def replayed(self, seq: int, ts: float) -> Action:
        """A batch from the replay socket (they come in order)."""
        expected = self.next
        if expected is None or seq == expected:
            return self._apply(seq, ts)
        if seq < expected:
            return Action.SKIP
        self.restarts += 1  # the buffer no longer covers the gap: rebuild from here
        self._apply(seq, ts)
        return Action.RESTART

    def dropped(self, seq: int) -> None:
        """A batch numbered ``seq`` whose payload could not be decoded: its number is taken
        (when it is the next one), so the batch after it is not a gap that a replay cannot
        fill, which would wipe the engine's whole index for one bad batch."""
        if self.next is None or seq == self.next:
            self.next = seq + 1

    def reset(self) -> None:
        self.next, self.last_ts = None, float("-inf")

    def _apply(self, seq: int, ts: float) -> Action:
        self.next, self.last_ts = seq + 1, ts
        return Action.APPLY
