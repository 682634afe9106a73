"""Admission control: at most N client requests served at once, a bounded queue with a
bounded wait, each tenant within its limits, and a 429 with ``Retry-After`` at once past
any bound, never a hang.

A slot is held from admission until the response is fully sent (a stream's last byte).
When a slot frees and someone waits, the slot passes straight to the waiter that
``flow.fair_queue`` puts first (priority band, the tenants' fair shares in tokens, then
earliest deadline and arrival), so a newcomer never overtakes the queue. Without a tenants
file every request is the default tenant's at priority 0 with no deadline: the queue is
first come, first served, as before.

A request with a deadline (``x-slo-ttft-ms``) is refused at once when the wait predicted
for it (the tokens queued ahead of it over the tokens the fleet has been releasing per
second) already passes its deadline, and leaves the queue with a 429 the moment its
deadline passes: it is never computed for a client that has given up.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import deque
from collections.abc import Callable

from pdproxy.config.listener import AdmissionConfig
from pdproxy.config.tenants import TenantsConfig
from pdproxy.errors import Overloaded
from pdproxy.flow.fair_queue import FairQueue
from pdproxy.flow.limits import TenantLimits
from pdproxy.flow.ticket import DEFAULT_TICKET, Ticket
from pdproxy.observability.flow_book import FlowBook
from pdproxy.observability.metrics import ProxyMetrics

if sys.version_info >= (3, 11):
    from asyncio import timeout as _deadline
else:  # pragma: no cover
    from async_timeout import timeout as _deadline

_RATE_WINDOW = 10.0  # seconds of releases the drain rate is measured over
_MAX_RELEASES = 4096  # releases kept for it (a busy proxy's window is cut to these)


class DrainRate:
    """The tokens (of ``Ticket.cost``) the admission has been handing slots to, per
    second, over the last ``_RATE_WINDOW`` seconds: how fast the queue drains."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._marks: deque[tuple[float, float]] = deque(maxlen=_MAX_RELEASES)
        self._total = 0.0

    def add(self, tokens: float) -> None:
        if len(self._marks) == self._marks.maxlen:
            self._total -= self._marks[0][1]
        self._marks.append((self._clock(), tokens))
        self._total += tokens

    def per_second(self) -> float | None:
        """None until the window has seen enough to say."""
        now = self._clock()
        marks = self._marks
        while marks and now - marks[0][0] > _RATE_WINDOW:
            self._total -= marks.popleft()[1]
        if len(marks) < 4:
            return None
        span = max(now - marks[0][0], 0.5)
        return self._total / span


class Admission:
    def __init__(
        self,
        config: AdmissionConfig,
        metrics: ProxyMetrics,
        tenants: TenantsConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        book: FlowBook | None = None,
    ) -> None:
        self._limit = config.max_concurrent  # 0: no global limit (tenant limits only)
        self._max_queued = config.max_queued
        self._wait = config.queue_timeout
        self._metrics = metrics
        self._clock = clock
        self.tenants = tenants if tenants is not None else TenantsConfig()
        self.book = book if book is not None else FlowBook(metrics, self.tenants)
        self.active = 0
        self._queue: FairQueue[asyncio.Future[None]] = FairQueue()
        self.limits = TenantLimits(clock)
        self.drain = DrainRate(clock)
        metrics.queue_depth.set_function(lambda: len(self._queue))

    @property
    def queued(self) -> int:
        return len(self._queue)

    def reload(self, tenants: TenantsConfig) -> None:
        """A new tenants file: queued requests keep their place and their tickets; new
        requests and each tenant's limits follow the new file."""
        self.tenants = tenants
        self.book.reconfigure(tenants)
        self.limits.reconfigure({**tenants.tenants, "default": tenants.default})

    async def acquire(self, ticket: Ticket = DEFAULT_TICKET) -> None:
        """Take a slot, waiting in line if allowed; raises ``Overloaded`` otherwise."""
        refusal = self.limits.admit(ticket)
        if refusal is not None:
            self.book.refused(ticket, refusal.reason)
            raise Overloaded(
                refusal.message,
                retry_after=refusal.retry_after,
                headers=refusal.headers,
                code="rate_limit_exceeded",
            )
        try:
            await self._slot(ticket)
        except BaseException:
            self.limits.release(ticket)
            raise
        self.book.admitted(ticket)

    def release(self, ticket: Ticket = DEFAULT_TICKET) -> None:
        """Give the slot back, or straight to the first waiter."""
        self.limits.release(ticket)
        self.book.finished(ticket)
        self._pass_on()

    def predicted_wait(self, ticket: Ticket) -> float | None:
        """Seconds ``ticket`` would wait for a slot now; None when unknown."""
        rate = self.drain.per_second()
        if rate is None or rate <= 0:
            return None
        return self._queue.tokens_ahead(ticket) / rate

    async def _slot(self, ticket: Ticket) -> None:
        if not self._limit or (self.active < self._limit and not self._queue):
            self.active += 1
            self.drain.add(ticket.cost)
            return
        if len(self._queue) >= self._max_queued:
            self._make_room(ticket)
        wait = self._wait
        if ticket.deadline is not None:
            left = ticket.deadline - self._clock()
            predicted = self.predicted_wait(ticket)
            if left <= 0 or (predicted is not None and predicted > left):
                raise self._refuse_deadline(ticket, predicted)
            wait = min(wait, left)
        waiter = asyncio.get_running_loop().create_future()
        entry = self._queue.push(ticket, waiter)
        started = self._clock()
        self.book.queued("admission", ticket)
        try:
            async with _deadline(wait):
                await waiter
        except asyncio.TimeoutError:
            self._queue.remove(entry)
            if ticket.deadline is not None and wait < self._wait:
                raise self._refuse_deadline(ticket, None) from None
            raise self._refuse(ticket, "queue_timeout", "no slot freed in time") from None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._pass_on()  # the slot was handed over as the client left: pass it on
            else:
                self._queue.remove(entry)
            raise
        finally:
            self.book.dequeued("admission", ticket, self._clock() - started)

    def _make_room(self, ticket: Ticket) -> None:
        """A full queue: ``ticket`` takes the place of a less important band's entry, or
        of a tenant's that holds more than its share of the queue; else it is refused.
        So a flood fills the queue, but cannot keep another tenant out of it."""
        displaced = self._queue.displace(ticket)
        if displaced is None:
            raise self._refuse(ticket, "queue_full", "too many requests in flight and queued")
        if not displaced.item.done():
            displaced.item.set_exception(
                self._refuse(
                    displaced.ticket,
                    "queue_full",
                    "the queue is full and this tenant holds the most of it",
                )
            )

    def _pass_on(self) -> None:
        while (entry := self._queue.pop()) is not None:
            if not entry.item.done():
                entry.item.set_result(None)
                self.drain.add(entry.ticket.cost)
                return
        self.active -= 1

    def _refuse(self, ticket: Ticket, reason: str, message: str) -> Overloaded:
        self.book.refused(ticket, reason)
        return Overloaded(f"pdproxy is at capacity: {message}; retry later", retry_after=1)

    def _refuse_deadline(self, ticket: Ticket, predicted: float | None) -> Overloaded:
        self.book.refused(ticket, "deadline")
        ms = ticket.deadline_ms
        why = (
            f"the predicted wait of {predicted * 1000:.0f} ms"
            if predicted is not None
            else "the wait for a slot"
        )
        return Overloaded(
            f"pdproxy cannot meet the request's deadline (x-slo-ttft-ms: {ms:g}): {why}"
            " passes it; retry later",
            retry_after=max(1, round(predicted or 1.0)),
            code="deadline_exceeded",
        )
