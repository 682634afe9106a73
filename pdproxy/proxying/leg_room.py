"""Each leg's wait for an engine with room, in flow-control order.

Under flow control (``--tenants``, or ``--prefill-capacity`` / ``--decode-capacity``), an
instance is **full** when this proxy's legs on it (plus the requests the engine runs for
others, while its figures are fresh) reach its capacity: the flag's figure, else what its
``/metrics`` taught (``EngineFigures.capacity``: the most requests it ran while others
waited). A leg whose role has no instance with room waits here, before it is sent, in the
order of ``flow.fair_queue`` (priority band, the tenants' fair shares in tokens, earliest
deadline): the prefill leg in the prefill's line, the decode leg in the decode's, so a
batch job that fills the decodes does not hold an interactive request's prefill, nor the
reverse. When a leg of a role ends, the first waiter of that role goes; a newcomer never
overtakes a waiter (a slot handed over is counted as ``granted`` until its leg starts).

Capacity unknown (no flag, nothing learned yet) is room: the engine's own queue takes
the leg, as without flow control. An empty pool is room too: the pick that follows
answers 503 at once rather than waiting for an instance that is not there. A waiter also
looks again every ``_RECHECK`` seconds, so an instance that joins, or a capacity learned
larger, lets it go without a leg ending first.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Iterable, Sequence

from pdproxy.errors import Overloaded
from pdproxy.flow.fair_queue import Entry, FairQueue
from pdproxy.flow.ticket import Ticket
from pdproxy.observability.flow_book import FlowBook
from pdproxy.types import Endpoint, Role

if sys.version_info >= (3, 11):
    from asyncio import timeout as _within
else:  # pragma: no cover
    from async_timeout import timeout as _within

_RECHECK = 0.25  # seconds between a waiter's own looks at its role's pool


class LegRoom:
    def __init__(
        self,
        *,
        capacity: dict[Role, int | None],
        book: FlowBook,
        max_wait: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # per role: N fixed per instance; None: learned from /metrics; 0: never wait
        self._capacity = capacity
        self._book = book
        self._max_wait = max_wait  # --queue-timeout-secs: a leg waits no longer
        self._clock = clock
        self._queues: dict[Role, FairQueue[asyncio.Future[None]]] = {
            Role.PREFILL: FairQueue(),
            Role.DECODE: FairQueue(),
        }
        self._granted = {Role.PREFILL: 0, Role.DECODE: 0}

    def waiting(self, role: Role) -> int:
        return len(self._queues[role])

    def capacity_of(self, endpoint: Endpoint) -> int:
        """Requests ``endpoint`` runs at once (0: unknown, never full)."""
        fixed = self._capacity.get(endpoint.role)
        if fixed is not None:
            return fixed
        return endpoint.load.capacity

    def free(self, endpoint: Endpoint) -> float:
        """Legs ``endpoint`` still has room for (``inf`` when its capacity is unknown)."""
        capacity = self.capacity_of(endpoint)
        if not capacity:
            return float("inf")
        figures = endpoint.load
        others = figures.others if self._clock() < figures.others_until else 0.0
        return capacity - endpoint.legs.in_flight - others

    def with_room(self, pool: tuple[Endpoint, ...]) -> tuple[Endpoint, ...]:
        """The instances of ``pool`` with room, or all of them when none has (the
        scheduler then chooses among full ones, as without flow control)."""
        open_ = tuple(e for e in pool if self.free(e) >= 1)
        return open_ if open_ and len(open_) < len(pool) else pool

    def _room(self, role: Role, pool: Iterable[Endpoint]) -> bool:
        total = 0.0
        seen = False
        for endpoint in pool:
            seen = True
            total += max(self.free(endpoint), 0.0)
            if total - self._granted[role] >= 1:
                return True
        return not seen

    async def wait(
        self, role: Role, pool: Callable[[], Sequence[Endpoint]], ticket: Ticket
    ) -> None:
        """Return once ``role`` has room for this leg. Raises ``Overloaded`` (429) when the
        wait passes ``--queue-timeout-secs`` or the request's deadline, and
        ``CancelledError`` when the request is cancelled meanwhile (its client left)."""
        if self._capacity.get(role) == 0:
            return
        queue = self._queues[role]
        if not queue and self._room(role, pool()):
            return
        limit = self._max_wait
        if ticket.deadline is not None:
            limit = min(limit, ticket.deadline - self._clock())
        stage = role.value
        started = self._clock()
        entry = queue.push(ticket, asyncio.get_running_loop().create_future())
        self._book.queued(stage, ticket)
        try:
            async with _within(max(limit, 0.0)):
                await self._await_turn(role, queue, entry, pool)
        except asyncio.TimeoutError:
            reason = "deadline" if limit < self._max_wait else "queue_timeout"
            self._book.refused(ticket, reason)
            raise Overloaded(
                f"no {stage} instance had room in time"
                + (
                    f" for the request's deadline (x-slo-ttft-ms: {ticket.deadline_ms:g})"
                    if reason == "deadline"
                    else ""
                )
                + "; retry later",
                retry_after=1,
                code="deadline_exceeded" if reason == "deadline" else None,
            ) from None
        finally:
            self._book.dequeued(stage, ticket, self._clock() - started)

    async def _await_turn(
        self,
        role: Role,
        queue: FairQueue[asyncio.Future[None]],
        entry: Entry[asyncio.Future[None]],
        pool: Callable[[], Sequence[Endpoint]],
    ) -> None:
        waiter = entry.item
        try:
            while True:
                try:
                    await asyncio.wait_for(asyncio.shield(waiter), _RECHECK)
                except asyncio.TimeoutError:
                    if self._room(role, pool()):  # room without a leg ending (a new
                        queue.remove(entry)  # instance, a larger capacity): go
                        waiter.cancel()
                        return
                    continue
                self._granted[role] -= 1  # handed over by a leg's end: it starts now
                return
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._granted[role] -= 1
                self._pass_on(role)  # handed over as it left: to the next
            else:
                queue.remove(entry)
                waiter.cancel()
            raise

    def freed(self, role: Role) -> None:
        """A leg of ``role`` ended: its room goes to the first waiter."""
        if self._queues[role]:
            self._pass_on(role)

    def _pass_on(self, role: Role) -> None:
        queue = self._queues[role]
        while queue and (entry := queue.pop()) is not None:
            if not entry.item.done():
                self._granted[role] += 1
                entry.item.set_result(None)
                return
