"""The order waiting requests get slots in (pdproxy.flow.fair_queue)."""

from __future__ import annotations

import random
from collections import Counter

from pdproxy.config.tenants import TenantSpec
from pdproxy.flow.fair_queue import FairQueue
from pdproxy.flow.ticket import Ticket


def _t(tenant="a", priority=0, cost=10.0, weight=1.0, deadline=None) -> Ticket:
    return Ticket(tenant, TenantSpec(weight=weight), priority, cost, cost, deadline)


def _drain(q: FairQueue[str]) -> list[str]:
    out = []
    while (e := q.pop()) is not None:
        out.append(e.item)
    return out


def test_a_lower_priority_number_goes_first_whatever_arrived_before():
    q: FairQueue[str] = FairQueue()
    for i in range(3):
        q.push(_t("batch", priority=10), f"b{i}")
    q.push(_t("chat", priority=0), "c0")
    q.push(_t("vip", priority=-5), "v0")
    assert _drain(q) == ["v0", "c0", "b0", "b1", "b2"]
    assert len(q) == 0 and q.pop() is None


def test_tenants_share_a_band_by_tokens_not_by_requests():
    # a sends 1,000-token requests, b 100-token ones: with equal weights, b gets ten
    # requests for each of a's while both wait.
    q: FairQueue[str] = FairQueue()
    for _ in range(20):
        q.push(_t("a", cost=1000.0), "a")
    for _ in range(200):
        q.push(_t("b", cost=100.0), "b")
    first = Counter(_drain(q)[:110])
    assert 9 <= first["a"] <= 11 and 99 <= first["b"] <= 101


def test_weights_divide_the_band_in_proportion():
    q: FairQueue[str] = FairQueue()
    for _ in range(400):
        q.push(_t("three", weight=3.0), "three")
        q.push(_t("one", weight=1.0), "one")
    first = Counter(_drain(q)[:400])
    assert abs(first["three"] / first["one"] - 3.0) < 0.1


def test_a_tenant_that_was_idle_gets_no_credit_for_it():
    q: FairQueue[str] = FairQueue()
    for _ in range(50):
        q.push(_t("busy"), "busy")
    for _ in range(40):
        assert q.pop() is not None  # busy ran alone: its tag is far ahead
    for _ in range(10):
        q.push(_t("late"), "late")
    order = _drain(q)[:10]
    assert 4 <= order.count("late") <= 6  # interleaved from now on, not all ten first


def test_within_a_tenant_the_earliest_deadline_then_arrival():
    q: FairQueue[str] = FairQueue()
    q.push(_t(deadline=None), "none")
    q.push(_t(deadline=5.0), "late")
    q.push(_t(deadline=1.0), "soon")
    q.push(_t(deadline=1.0), "soon-second")
    assert _drain(q) == ["soon", "soon-second", "late", "none"]


def test_removed_entries_are_never_served_and_leave_nothing_behind():
    q: FairQueue[str] = FairQueue()
    entries = [q.push(_t("a", priority=p % 3), f"x{i}") for i, p in enumerate(range(30))]
    for e in entries[::2]:
        q.remove(e)
        q.remove(e)  # twice is once
    assert len(q) == 15
    served = _drain(q)
    assert len(served) == 15 and all(int(s[1:]) % 2 == 1 for s in served)
    assert q.depths() == {} and q.tokens_ahead(_t()) == 0.0


def test_a_starved_band_keeps_no_garbage_of_requests_that_left():
    q: FairQueue[str] = FairQueue()
    q.push(_t("chat", priority=0), "keep")
    for _ in range(10_000):  # batch requests that time out while chat keeps the band
        q.remove(q.push(_t("batch", priority=10), "gone"))
    assert len(q) == 1 and len(q._order) < 16 and 10 not in q._bands


def test_random_operations_keep_the_counts():
    rng = random.Random(7)
    q: FairQueue[int] = FairQueue()
    live = {}
    for step in range(5000):
        op = rng.random()
        if op < 0.5:
            t = _t(rng.choice("abcd"), rng.randint(0, 3), rng.uniform(1, 100))
            live[step] = q.push(t, step)
        elif op < 0.7 and live:
            key = rng.choice(list(live))
            q.remove(live.pop(key))
        else:
            e = q.pop()
            if e is not None:
                assert live.pop(e.item) is e
        assert len(q) == len(live)
    assert sorted(e.item for e in iter(q.pop, None)) == sorted(live)


def test_tokens_ahead_counts_earlier_bands_and_the_fair_part_of_its_own():
    q: FairQueue[str] = FairQueue()
    q.push(_t("vip", priority=-1, cost=500.0), "v")
    for _ in range(10):
        q.push(_t("flood", cost=100.0), "f")
    q.push(_t("low", priority=5, cost=1000.0), "l")
    # a newcomer of "quiet" (nothing queued) at priority 0 waits behind vip's 500 and,
    # of flood's 1,000, as much as its own 50 tokens: the shares interleave
    assert q.tokens_ahead(_t("quiet", cost=50.0)) == 500.0 + 50.0
    assert q.tokens_ahead(_t("flood", cost=100.0)) == 500.0 + 1000.0


def test_a_full_queue_displaces_the_heaviest_tenant_not_the_newcomer():
    q: FairQueue[str] = FairQueue()
    for i in range(8):
        q.push(_t("flood"), f"f{i}")
    q.push(_t("quiet"), "q0")
    out = q.displace(_t("quiet"))  # quiet holds 10 tokens (20 with it), flood 80
    assert out is not None and out.ticket.tenant == "flood" and len(q) == 8
    assert q.displace(_t("flood")) is None  # the heaviest tenant itself is refused
    even: FairQueue[str] = FairQueue()
    even.push(_t("a"), "a0")
    assert even.displace(_t("b")) is None  # b with it would hold as much as a: no one owes


def test_a_full_queue_displaces_a_less_important_band_first_and_never_a_more_important():
    q: FairQueue[str] = FairQueue()
    q.push(_t("chat", priority=0, cost=1000.0), "c0")
    q.push(_t("batch", priority=10), "b0")
    out = q.displace(_t("chat", priority=5))
    assert out is not None and out.item == "b0"
    assert q.displace(_t("batch", priority=10)) is None  # only chat's band is left: above it
    weighted: FairQueue[str] = FairQueue()
    for _ in range(3):
        weighted.push(_t("heavy", weight=3.0), "h")
    assert weighted.displace(_t("light", weight=1.0)) is None  # 30/3 = 10 = light's 10/1
