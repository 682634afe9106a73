"""Admission control: at most N client requests served at once, a bounded FIFO queue with a
bounded wait, and a 429 with ``Retry-After`` at once past either bound, never a hang.

A slot is held from admission until the response is fully sent (a stream's last byte).
When a slot frees and someone waits, the slot passes to the oldest waiter directly, so a
newcomer never overtakes the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections import deque

from pdproxy.config.listener import AdmissionConfig
from pdproxy.errors import Overloaded
from pdproxy.observability.metrics import ProxyMetrics

if sys.version_info >= (3, 11):
    from asyncio import timeout as _deadline
else:  # pragma: no cover
    from async_timeout import timeout as _deadline


class Admission:
    def __init__(self, config: AdmissionConfig, metrics: ProxyMetrics) -> None:
        self._limit = config.max_concurrent
        self._max_queued = config.max_queued
        self._wait = config.queue_timeout
        self._metrics = metrics
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        metrics.queue_depth.set_function(lambda: len(self._waiters))

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        """Take a slot, waiting in line if allowed; raises ``Overloaded`` otherwise."""
        if self.active < self._limit and not self._waiters:
            self.active += 1
            return
        if len(self._waiters) >= self._max_queued:
            raise self._refuse("queue_full", "too many requests in flight and queued")
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with _deadline(self._wait):
                await waiter
        except asyncio.TimeoutError:
            self._forget(waiter)
            raise self._refuse("queue_timeout", "no slot freed in time") from None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot was handed over as the client left: pass it on
            else:
                self._forget(waiter)
            raise

    def release(self) -> None:
        """Give the slot back, or straight to the oldest waiter."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.active -= 1

    def _forget(self, waiter: asyncio.Future[None]) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(waiter)

    def _refuse(self, reason: str, message: str) -> Overloaded:
        self._metrics.admission_rejected.labels(reason).inc()
        return Overloaded(f"pdproxy is at capacity: {message}; retry later", retry_after=1)
