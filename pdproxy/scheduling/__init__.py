"""Scheduling: pure policy choosing a prefill and a decode for each request.

A scheduler sees an immutable ``Snapshot`` of routable instances and returns a
``PairDecision``. It never awaits, never does I/O and raises ``NoEndpointAvailable`` when a
role has no instance.
"""

from __future__ import annotations

from typing import Protocol

from pdproxy.types import PairDecision, Snapshot


class Scheduler(Protocol):
    def schedule(self, snapshot: Snapshot) -> PairDecision:
        """Pick a prefill and a decode from ``snapshot`` (and a DP rank on P if it has several)."""
        ...
