import random

import pytest

from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.errors import NoEndpointAvailable
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.proxying.leg_counts import enter, leave
from pdproxy.scheduling.context import RequestFeatures
from pdproxy.scheduling.scheduler import Scheduler
from pdproxy.types import Endpoint, EndpointState, EngineAddress, Role, Source


class RoundRobinScheduler:
    """Round robin on both roles through the scheduler, as pdproxy had before policies."""

    def __init__(self):
        config = SchedulingConfig(prefill_policy="round-robin", decode_policy="round_robin")
        self._scheduler = Scheduler(config, clock=lambda: 0.0, rng=random.Random(0), max_age=3)

    def schedule(self, snapshot):
        return self._scheduler.schedule(RequestFeatures(), snapshot)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def _add_static(reg, role, addresses):
    for address in addresses:
        reg.add(Endpoint.new(role=role, address=address, source=Source.STATIC))


def _reg(n_p=2, n_d=2, dp=1):
    reg = EndpointRegistry(Clock())
    _add_static(
        reg, Role.PREFILL, [EngineAddress(url=f"http://p{i}:1", dp_size=dp) for i in range(n_p)]
    )
    _add_static(reg, Role.DECODE, [EngineAddress(url=f"http://d{i}:1") for i in range(n_d)])
    return reg


def test_round_robin_alternates_independently():
    reg, s = _reg(2, 3), RoundRobinScheduler()
    picks = [s.schedule(reg.snapshot()) for _ in range(6)]
    assert [p.prefill.url for p in picks] == ["http://p0:1", "http://p1:1"] * 3
    assert [p.decode.url for p in picks] == ["http://d0:1", "http://d1:1", "http://d2:1"] * 2
    assert all(p.prefill_dp_rank is None for p in picks)


def test_round_robin_cycles_dp_ranks():
    reg, s = _reg(1, 1, dp=2), RoundRobinScheduler()
    assert [s.schedule(reg.snapshot()).prefill_dp_rank for _ in range(4)] == [0, 1, 0, 1]


@pytest.mark.parametrize(("n_p", "n_d"), [(0, 1), (1, 0)])
def test_empty_role_is_503(n_p, n_d):
    with pytest.raises(NoEndpointAvailable) as exc:
        RoundRobinScheduler().schedule(_reg(n_p, n_d).snapshot())
    assert exc.value.status == 503


def test_draining_and_removed_are_not_routable():
    reg = _reg(2, 1)
    reg.set_state("http://p0:1", EndpointState.DRAINING)
    assert [e.url for e in reg.snapshot().prefill] == ["http://p1:1"]
    reg.remove("http://p1:1")
    assert reg.snapshot().prefill == ()


def test_a_replacement_takes_the_leg_counts_its_legs_in_flight_uncount():
    """Issue 30: a replaced instance's legs in flight hold the old ``Endpoint`` and leave it
    there; the registry carries that ``LegCounts`` over whole, so the count the URL shows
    comes down with them (a copied ``in_flight`` stayed up for good)."""
    reg = EndpointRegistry(Clock())
    url = "http://r:1"
    old = Endpoint.new(role=Role.DECODE, address=EngineAddress(url=url), source=Source.REGISTERED)
    reg.add(old)
    enter(old, 0)
    moved = EngineAddress(url=url, zmq_address="10.0.0.9:6666")
    new = Endpoint.new(role=Role.DECODE, address=moved, source=Source.REGISTERED)
    reg.add(new)
    assert reg.get(url) is new and new.legs.in_flight == 1
    leave(old, 0)
    assert new.legs.in_flight == 0 and new.legs.work == 0.0 and new.legs.rank_in_flight == [0]


def test_a_replacement_is_told_to_its_listeners_and_the_first_add_is_not():
    """A replacement is a new instance: build wires ``on_replace`` to the legs, which forget
    its KV sources (as the fresh record of before the counts were carried over did)."""
    reg = EndpointRegistry(Clock())
    heard: list[Endpoint] = []
    reg.on_replace(heard.append)
    url = "http://r:1"
    first = Endpoint.new(role=Role.DECODE, address=EngineAddress(url=url), source=Source.REGISTERED)
    reg.add(first)
    assert heard == []
    second = Endpoint.new(
        role=Role.DECODE, address=EngineAddress(url=url), source=Source.REGISTERED
    )
    reg.add(second)
    assert heard == [second]


def test_expiry_spares_static_and_keeps_in_flight_on_upsert():
    clock = Clock()
    reg = EndpointRegistry(clock)
    _add_static(reg, Role.DECODE, [EngineAddress(url="http://s:1")])
    dyn = Endpoint.new(
        role=Role.PREFILL, address=EngineAddress(url="http://r:1"), source=Source.REGISTERED
    )
    reg.add(dyn)
    reg.touch("http://r:1", ttl=5, last_seen=0)
    dyn.legs.in_flight = 3
    again = Endpoint.new(
        role=Role.PREFILL, address=EngineAddress(url="http://r:1"), source=Source.REGISTERED
    )
    reg.add(again)
    assert again.legs.in_flight == 3
    reg.touch("http://r:1", ttl=5, last_seen=0)
    clock.now += 4.9
    assert reg.expire() == []
    clock.now += 0.2
    assert [e.url for e in reg.expire()] == ["http://r:1"]
    assert reg.get("http://s:1") is not None
