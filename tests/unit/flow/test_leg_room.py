"""Each leg's wait for an engine with room (pdproxy.proxying.leg_room): the order of the
waiters, the hand-over on a leg's end, and every way out of the line."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import CollectorRegistry

from pdproxy.config.tenants import TenantsConfig, TenantSpec
from pdproxy.errors import Overloaded
from pdproxy.flow.ticket import Ticket
from pdproxy.observability.flow_book import FlowBook
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.proxying.leg_counts import enter, leave
from pdproxy.proxying.leg_room import LegRoom
from pdproxy.types import Endpoint, EngineAddress, Role, Source


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _endpoint(port: int, role: Role = Role.PREFILL) -> Endpoint:
    return Endpoint.new(
        role=role, address=EngineAddress(url=f"http://127.0.0.1:{port}"), source=Source.STATIC
    )


def _t(tenant: str, priority: int = 0, cost: float = 10.0, deadline: float | None = None):
    ms = None if deadline is None else 1000.0
    return Ticket(tenant, TenantSpec(), priority, cost, cost, deadline, ms)


def _room(capacity: int | None = 1, max_wait: float = 30.0, clock=None):
    metrics = ProxyMetrics(CollectorRegistry())
    book = FlowBook(metrics, TenantsConfig())
    room = LegRoom(
        capacity={Role.PREFILL: capacity, Role.DECODE: capacity},
        book=book,
        max_wait=max_wait,
        clock=clock or _Clock(),
    )
    return room, book, metrics


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_full_role_releases_its_waiters_in_priority_order_as_legs_end():
    room, book, _ = _room(capacity=1)
    p = _endpoint(1)
    enter(p, None)  # the one slot is taken
    order: list[str] = []

    async def leg(name: str, ticket: Ticket) -> None:
        await room.wait(Role.PREFILL, lambda: (p,), ticket)
        order.append(name)
        enter(p, None)

    tasks = [asyncio.create_task(leg(f"batch{i}", _t("batch", 10))) for i in range(3)]
    await _settle()
    tasks.append(asyncio.create_task(leg("chat", _t("chat", 0))))
    await _settle()
    assert order == [] and room.waiting(Role.PREFILL) == 4
    assert book.status()["queued"] == 4
    for _ in range(4):
        leave(p, None)
        room.freed(Role.PREFILL)
        await _settle()
    assert order == ["chat", "batch0", "batch1", "batch2"]
    await asyncio.gather(*tasks)
    assert room.waiting(Role.PREFILL) == 0 and book.status()["queued"] == 0


async def test_a_newcomer_never_overtakes_a_waiter_handed_the_slot():
    room, _, _ = _room(capacity=1)
    p = _endpoint(1)
    enter(p, None)
    first = asyncio.create_task(room.wait(Role.PREFILL, lambda: (p,), _t("a")))
    await _settle()
    leave(p, None)
    room.freed(Role.PREFILL)  # handed to `first`, which has not run yet
    late = asyncio.create_task(room.wait(Role.PREFILL, lambda: (p,), _t("b")))
    await _settle()
    assert first.done() and not late.done()  # granted counts until the leg starts
    assert room.waiting(Role.PREFILL) == 1
    late.cancel()
    with pytest.raises(asyncio.CancelledError):
        await late


async def test_unknown_capacity_and_an_empty_pool_are_room():
    room, _, _ = _room(capacity=None)  # to be learned: nothing learned yet
    p = _endpoint(1)
    for _ in range(50):
        enter(p, None)
    await asyncio.wait_for(room.wait(Role.PREFILL, lambda: (p,), _t("a")), 1)
    p.load.capacity = 50  # the engine's /metrics taught it
    room2, _, _ = _room(capacity=None)
    waiting = asyncio.create_task(room2.wait(Role.PREFILL, lambda: (p,), _t("a")))
    await _settle()
    assert not waiting.done()
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    await asyncio.wait_for(room2.wait(Role.PREFILL, lambda: (), _t("a")), 1)  # 503 follows


async def test_zero_capacity_never_waits():
    room, _, _ = _room(capacity=0)
    p = _endpoint(1)
    enter(p, None)
    await asyncio.wait_for(room.wait(Role.PREFILL, lambda: (p,), _t("a")), 1)


async def test_a_client_that_leaves_leaves_the_line_and_a_slot_handed_over_passes_on():
    room, book, _ = _room(capacity=1)
    p = _endpoint(1)
    enter(p, None)
    gone = asyncio.create_task(room.wait(Role.PREFILL, lambda: (p,), _t("a")))
    stays = asyncio.create_task(room.wait(Role.PREFILL, lambda: (p,), _t("b")))
    await _settle()
    leave(p, None)
    room.freed(Role.PREFILL)  # handed to `gone`...
    gone.cancel()  # ...whose client leaves before it runs
    await asyncio.gather(gone, return_exceptions=True)
    await asyncio.wait_for(stays, 1)  # the slot went on to the next
    assert room.waiting(Role.PREFILL) == 0 and book.status()["queued"] == 0


async def test_a_wait_ends_with_429_at_the_queue_timeout_or_the_deadline():
    clock = _Clock()
    room, book, metrics = _room(capacity=1, max_wait=0.05, clock=clock)
    p = _endpoint(1)
    enter(p, None)
    with pytest.raises(Overloaded) as timed_out:
        await room.wait(Role.PREFILL, lambda: (p,), _t("a"))
    assert timed_out.value.code is None
    room2, book2, _ = _room(capacity=1, max_wait=30.0, clock=clock)
    with pytest.raises(Overloaded) as late:
        await asyncio.wait_for(
            room2.wait(Role.PREFILL, lambda: (p,), _t("a", deadline=clock.now + 0.05)), 5
        )
    assert late.value.code == "deadline_exceeded" and "x-slo-ttft-ms" in str(late.value)
    assert book.status()["tenants"]["a"]["refused"] == {"queue_timeout": 1}
    assert book2.status()["tenants"]["a"]["refused"] == {"deadline": 1}
    assert room.waiting(Role.PREFILL) == room2.waiting(Role.PREFILL) == 0
    rejected = metrics.registry.get_sample_value(
        "pdproxy_admission_rejected_total", {"reason": "queue_timeout"}
    )
    assert rejected == 1


async def test_an_instance_that_joins_lets_a_waiter_go_without_a_leg_ending():
    room, _, _ = _room(capacity=1)
    p, q = _endpoint(1), _endpoint(2)
    enter(p, None)
    pool: tuple[Endpoint, ...] = (p,)
    waiting = asyncio.create_task(room.wait(Role.PREFILL, lambda: pool, _t("a")))
    await _settle()
    assert not waiting.done()
    pool = (p, q)
    await asyncio.wait_for(waiting, 2)  # its own look again found room


async def test_with_room_prefers_instances_with_room_and_keeps_all_when_none_has():
    room, _, _ = _room(capacity=1)
    p, q = _endpoint(1), _endpoint(2)
    enter(p, None)
    assert room.with_room((p, q)) == (q,)
    enter(q, None)
    assert room.with_room((p, q)) == (p, q)


async def test_the_roles_wait_apart():
    room, _, _ = _room(capacity=1)
    d = _endpoint(2, Role.DECODE)
    p = _endpoint(1)
    enter(d, None)  # the decodes are full
    await asyncio.wait_for(room.wait(Role.PREFILL, lambda: (p,), _t("chat")), 1)
    waiting = asyncio.create_task(room.wait(Role.DECODE, lambda: (d,), _t("chat")))
    await _settle()
    assert not waiting.done() and room.waiting(Role.PREFILL) == 0
    leave(d, None)
    room.freed(Role.DECODE)
    await asyncio.wait_for(waiting, 1)


def test_a_capacity_is_learned_only_while_the_engine_had_requests_waiting():
    from pdproxy.membership.load_scraper import apply_load
    from pdproxy.types import EngineLoad

    p = _endpoint(1)
    apply_load(p, EngineLoad(running=9, waiting=0, kv_usage=0.1, scraped_at=1.0), 10.0)
    assert p.load.capacity == 0  # nothing waited: 9 is not a limit
    apply_load(p, EngineLoad(running=4, waiting=2, kv_usage=0.1, scraped_at=2.0), 10.0)
    assert p.load.capacity == 4
    apply_load(p, EngineLoad(running=3, waiting=5, kv_usage=0.9, scraped_at=3.0), 10.0)
    assert p.load.capacity == 4  # the largest seen
    apply_load(p, EngineLoad(running=1e15, waiting=1, kv_usage=0.1, scraped_at=4.0), 10.0)
    assert p.load.capacity == 1_000_000  # a hostile page's figure is bounded
