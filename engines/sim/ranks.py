"""One engine core per data-parallel rank: admission, prefill compute lanes, running blocks.

vLLM runs one engine core per DP rank, each with its own scheduler (`--max-num-seqs` is per
rank) and its own accelerator. A request runs on the rank its `X-data-parallel-rank` header
names (rank 0 without it). The prefix cache, the block pool and the counters stay shared.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from engines.sim.scheduler import Scheduler


@dataclass
class Rank:
    """The state of one engine core."""

    scheduler: Scheduler  # running slots; requests past max_running wait (num_requests_waiting)
    lanes: Scheduler | None  # prefill compute lanes; None means unlimited
    running_blocks: int = 0  # KV blocks of the requests running here

    async def compute(self, seconds: float) -> None:
        """Spend `seconds` of prefill compute on this rank's accelerator.

        With limited lanes a request waits, FIFO, for a free lane first; it has been admitted
        already, so it counts as running meanwhile (as a request vLLM scheduled does).
        """
        if seconds <= 0:
            return
        if self.lanes is None:
            await asyncio.sleep(seconds)
            return
        await self.lanes.acquire()
        try:
            await asyncio.sleep(seconds)
        finally:
            self.lanes.release()


def make_ranks(
    dp_size: int, max_running: int, prefill_concurrency: int, by_priority: bool = False
) -> list[Rank]:
    """`prefill_concurrency` 0 means unlimited lanes (every request computes at once);
    `by_priority`: waiting requests by (priority, arrival), vLLM's priority policy."""
    return [
        Rank(
            Scheduler(max_running, by_priority),
            Scheduler(prefill_concurrency) if prefill_concurrency > 0 else None,
        )
        for _ in range(dp_size)
    ]
