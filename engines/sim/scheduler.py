"""Admission: at most max_running requests run; the rest wait in FIFO order."""

from __future__ import annotations

import asyncio
from collections import deque


class Scheduler:
    def __init__(self, max_running: int) -> None:
        self.max_running = max_running
        self.running = 0
        self._waiting: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return sum(1 for f in self._waiting if not f.done())

    def try_acquire(self) -> bool:
        """Take a slot at once if one is free and nobody waits."""
        if self.running < self.max_running and not self._waiting:
            self.running += 1
            return True
        return False

    async def acquire(self) -> None:
        if self.try_acquire():
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # the slot was handed over just as we were cancelled
            raise
        finally:
            if fut in self._waiting:
                self._waiting.remove(fut)

    def release(self) -> None:
        while self._waiting:
            fut = self._waiting.popleft()
            if not fut.done():
                fut.set_result(None)  # hand the slot over; running stays the same
                return
        self.running -= 1
