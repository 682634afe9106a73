"""Admission: at most max_running requests run; the rest wait, first come first served,
or under ``--scheduling-policy priority`` (vLLM's) by (priority, arrival): a lower
``priority`` first, as vLLM's priority scheduler orders its waiting queue."""

from __future__ import annotations

import asyncio
import heapq
import itertools


class Scheduler:
    def __init__(self, max_running: int, by_priority: bool = False) -> None:
        self.max_running = max_running
        self.by_priority = by_priority
        self.running = 0
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []  # a heap
        self._seq = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for _, _, f in self._waiting if not f.done())

    def try_acquire(self) -> bool:
        """Take a slot at once if one is free and nobody waits."""
        if self.running < self.max_running and not self._waiting:
            self.running += 1
            return True
        return False

    async def acquire(self, priority: int = 0) -> None:
        if self.try_acquire():
            return
        fut = asyncio.get_running_loop().create_future()
        entry = (priority if self.by_priority else 0, next(self._seq), fut)
        heapq.heappush(self._waiting, entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed over just as we were cancelled
            raise
        finally:
            if entry in self._waiting:
                self._waiting.remove(entry)
                heapq.heapify(self._waiting)

    def release(self) -> None:
        while self._waiting:
            _, _, fut = heapq.heappop(self._waiting)
            if not fut.done():
                fut.set_result(None)  # hand the slot over; running stays the same
                return
        self.running -= 1
