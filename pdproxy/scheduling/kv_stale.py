"""Staleness by time: an engine rank whose events stopped while it was sent work. Pure.

An engine publishes a batch whenever it stores or evicts blocks, so one that is sent a
leg which should store new blocks (``Scheduler`` says which) and publishes nothing for
``after`` seconds has stopped publishing, or its publisher is unreachable without a
disconnect to show it. It is stale: scored by the approximate index (``KVIndex.live``
loses it) until its next batch. An idle engine publishes nothing and is never stale: the
clock starts with the first leg sent since its last batch. ``after`` 0 turns it off.
Both changes are logged, once each.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class Staleness:
    def __init__(self, after: float) -> None:
        self.after = after
        self.stale: set[str] = set()
        # rank -> when the first leg since its last batch was sent (monotonic)
        self._waiting: dict[str, float] = {}

    def sent(self, name: str, now: float) -> None:
        """A leg that should make ``name`` publish was sent at ``now``."""
        if self.after > 0:
            self._waiting.setdefault(name, now)

    def heard(self, name: str) -> bool:
        """``name`` published a batch; True when that ends its staleness."""
        if self._waiting:
            self._waiting.pop(name, None)
        if name not in self.stale:
            return False
        self.stale.discard(name)
        logger.warning("KV events of %s flow again: scored from its events", name)
        return True

    def sweep(self, now: float) -> list[str]:
        """The ranks that became stale by ``now``."""
        newly = [
            name
            for name, since in self._waiting.items()
            if now - since >= self.after and name not in self.stale
        ]
        for name in newly:
            self.stale.add(name)
            logger.warning(
                "KV events of %s: no batch for %.1f s while it was sent work: stale, "
                "the approximate index scores it until its events flow again",
                name,
                now - self._waiting[name],
            )
        return newly

    def waiting_since(self, name: str) -> float | None:
        return self._waiting.get(name)

    def forget(self, name: str) -> None:
        self._waiting.pop(name, None)
        self.stale.discard(name)
