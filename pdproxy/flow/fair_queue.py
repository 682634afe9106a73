"""The order in which waiting requests get a slot.

1. By priority band: a lower ``priority`` first. A band waits only while a band of a
   lower number has work (strict priority: a batch band can wait as long as interactive
   work keeps arriving; that is the point of giving it a higher number).
2. Within a band, weighted fair shares between tenants, counted in tokens (start-time fair
   queuing): each tenant has a tag that grows by a request's cost over the tenant's weight
   when the request is released; the tenant with the smallest tag goes next, and a tenant
   that was idle starts at the band's current tag (it gets no credit for its idle time).
3. Within a tenant, earliest deadline first, then arrival.

Pure data structure: the entries it holds are whatever the caller waits on.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from pdproxy.flow.ticket import Ticket

T = TypeVar("T")


@dataclass(slots=True, eq=False)
class Entry(Generic[T]):
    ticket: Ticket
    item: T
    seq: int
    removed: bool = False
    flow: _Flow[T] | None = None


@dataclass(slots=True, eq=False)
class _Flow(Generic[T]):
    """One tenant's waiting requests within a band."""

    weight: float
    tag: float = 0.0
    live: int = 0
    tokens: float = 0.0  # the live entries' cost
    scheduled: bool = False  # has a current entry in its band's heap
    entries: list[tuple[float, int, Entry[T]]] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class _Band(Generic[T]):
    vtime: float = 0.0
    live: int = 0
    tokens: float = 0.0
    flows: dict[str, _Flow[T]] = field(default_factory=dict)
    ready: list[tuple[float, int, str]] = field(default_factory=list)  # (tag, seq, tenant)


class FairQueue(Generic[T]):
    def __init__(self) -> None:
        self._bands: dict[int, _Band[T]] = {}
        self._order: list[int] = []  # the bands' priorities, a heap (lazily cleaned)
        self._seq = itertools.count()
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def push(self, ticket: Ticket, item: T) -> Entry[T]:
        band = self._bands.get(ticket.priority)
        if band is None:
            band = self._bands[ticket.priority] = _Band()
            if ticket.priority not in self._order:  # O(bands): a new band is rare
                heapq.heappush(self._order, ticket.priority)
        flow = band.flows.get(ticket.tenant)
        if flow is None:
            flow = band.flows[ticket.tenant] = _Flow(ticket.spec.weight, tag=band.vtime)
        elif flow.live == 0:
            flow.tag = max(flow.tag, band.vtime)  # no credit for an idle spell
        seq = next(self._seq)
        entry = Entry(ticket, item, seq, flow=flow)
        deadline = math.inf if ticket.deadline is None else ticket.deadline
        heapq.heappush(flow.entries, (deadline, seq, entry))
        flow.live += 1
        flow.tokens += ticket.cost
        band.live += 1
        band.tokens += ticket.cost
        self._live += 1
        if not flow.scheduled:
            flow.scheduled = True
            heapq.heappush(band.ready, (flow.tag, seq, ticket.tenant))
        return entry

    def remove(self, entry: Entry[T]) -> None:
        """``entry`` leaves the queue (its client left, its wait ended)."""
        if entry.removed:
            return
        entry.removed = True
        self._count_out(entry)

    def pop(self) -> Entry[T] | None:
        """The next entry to serve, or None when none waits."""
        while self._order:
            priority = self._order[0]
            band = self._bands.get(priority)
            if band is None:
                heapq.heappop(self._order)
                continue
            entry = self._pop_band(band)
            if entry is not None:
                return entry
            heapq.heappop(self._order)  # unreachable while the counts hold: never spin
        return None

    def tokens_ahead(self, ticket: Ticket) -> float:
        """Tokens a newcomer like ``ticket`` would wait behind: all of the bands served
        before its own, and in its own band each tenant's waiting tokens up to what that
        tenant's share allows beside the newcomer's tenant (its tokens ahead plus its own
        cost, scaled by the weights), as the fair shares would interleave them."""
        ahead = 0.0
        for priority, band in self._bands.items():
            if priority < ticket.priority:
                ahead += band.tokens
            elif priority == ticket.priority:
                own = band.flows.get(ticket.tenant)
                mine = (own.tokens if own is not None else 0.0) + ticket.cost
                share = mine / ticket.spec.weight
                ahead += sum(
                    min(flow.tokens, share * flow.weight)
                    for name, flow in band.flows.items()
                    if name != ticket.tenant
                )
                ahead += mine - ticket.cost
        return ahead

    def displace(self, ticket: Ticket) -> Entry[T] | None:
        """When the queue is full, the entry a newcomer like ``ticket`` takes the place of:
        one of the least important band's if that band is less important than the
        newcomer's, else, in the newcomer's own band, one of the tenant waiting with the
        most tokens when that is another tenant and it holds more than the newcomer's
        tenant would with it (over their weights). None: the newcomer is the one refused.
        The entry is removed; its waiter is the caller's to tell."""
        if not self._bands:
            return None
        worst = max(self._bands)
        if worst < ticket.priority:
            return None
        band = self._bands[worst]
        name, flow = max(band.flows.items(), key=lambda kv: kv[1].tokens / kv[1].weight)
        if worst == ticket.priority:
            own = band.flows.get(ticket.tenant)
            mine = (own.tokens if own is not None else 0.0) + ticket.cost
            if name == ticket.tenant or flow.tokens / flow.weight <= mine / ticket.spec.weight:
                return None
        for _, _, entry in reversed(flow.entries):  # a heap's last leaves: among the latest
            if not entry.removed:
                self.remove(entry)
                return entry
        return None

    def depths(self) -> dict[tuple[int, str], int]:
        """Waiting requests by (priority, tenant)."""
        return {
            (p, name): flow.live
            for p, band in self._bands.items()
            for name, flow in band.flows.items()
            if flow.live
        }

    def _pop_band(self, band: _Band[T]) -> Entry[T] | None:
        while band.ready:
            tag, _, tenant = heapq.heappop(band.ready)
            flow = band.flows.get(tenant)
            if flow is None:
                continue
            flow.scheduled = False
            entry = _pop_flow(flow)
            if entry is None:  # every entry of it was removed: it is idle now
                del band.flows[tenant]
                continue
            band.vtime = max(band.vtime, tag)
            flow.tag = tag + entry.ticket.cost / flow.weight
            entry.removed = True
            self._count_out(entry)
            if flow.live:
                flow.scheduled = True
                heapq.heappush(band.ready, (flow.tag, entry.seq, tenant))
            return entry
        return None

    def _count_out(self, entry: Entry[T]) -> None:
        flow = entry.flow
        assert flow is not None
        cost = entry.ticket.cost
        flow.live -= 1
        flow.tokens -= cost
        if flow.live == 0:
            flow.entries.clear()  # all removed: no garbage kept for a starved band
        elif len(flow.entries) > 2 * flow.live + 8:
            flow.entries = [e for e in flow.entries if not e[2].removed]
            heapq.heapify(flow.entries)
        priority = entry.ticket.priority
        band = self._bands[priority]
        band.live -= 1
        band.tokens -= cost
        self._live -= 1
        if band.live == 0:
            del self._bands[priority]  # an idle band starts afresh
            if len(self._order) > 2 * len(self._bands) + 8:
                self._order = list(self._bands)
                heapq.heapify(self._order)


def _pop_flow(flow: _Flow[T]) -> Entry[T] | None:
    while flow.entries:
        _, _, entry = heapq.heappop(flow.entries)
        if not entry.removed:
            return entry
    return None
