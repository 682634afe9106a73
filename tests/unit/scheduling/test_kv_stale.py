"""Staleness by time: an engine rank sent work that publishes nothing falls back to the
approximate index, and returns when its batches flow again."""

import logging

from engines.sim.kv_events import stored
from pdproxy.scheduling.context import RequestFeatures
from pdproxy.scheduling.kv_events import KVIndex, decode_batch
from pdproxy.scheduling.kv_keys import instance_name
from pdproxy.scheduling.kv_stale import Staleness
from pdproxy.types import Role, Snapshot
from tests.unit.scheduling.helpers import endpoint, scheduler

IDS = list(range(500, 628))  # 8 blocks of 16


def test_only_a_rank_sent_work_goes_stale_and_only_after_the_delay():
    s = Staleness(30.0)
    assert s.sweep(1000.0) == []  # idle: never stale, however long it is quiet
    s.sent("a", 100.0)
    s.sent("a", 120.0)  # the clock runs from the first leg since the last batch
    assert s.sweep(129.9) == []
    assert s.sweep(130.0) == ["a"] and s.stale == {"a"}
    assert s.sweep(500.0) == []  # logged and reported once
    assert s.heard("a") is True and s.stale == set()
    assert s.heard("a") is False
    assert s.sweep(1000.0) == []  # the batch reset the clock: no leg since


def test_zero_turns_it_off():
    s = Staleness(0.0)
    s.sent("a", 0.0)
    assert s.sweep(1e9) == [] and s.stale == set()


def test_a_stale_rank_leaves_live_and_comes_back_with_its_next_batch(caplog):
    index = KVIndex(100, stale_after=30.0)
    index.follow("a")
    index.expect("b", 0.0)  # not followed: nothing to wait for
    index.expect("a", 10.0)
    index.sweep(39.0)
    assert "a" in index.live
    with caplog.at_level(logging.WARNING, logger="pdproxy.scheduling.kv_stale"):
        index.sweep(40.0)
        index.sweep(50.0)
    assert "a" not in index.live and "a" in index.followed
    assert len([r for r in caplog.records if "stale" in r.getMessage()]) == 1
    version = index.live_version
    index.heard("a")
    assert "a" in index.live and index.live_version > version
    index.expect("a", 60.0)
    index.unfollow("a")  # an instance that left forgets its clock
    assert index.staleness.waiting_since("a") is None


def test_a_distrusted_rank_stays_out_when_its_staleness_ends():
    index = KVIndex(100, stale_after=1.0)
    index.follow("a")
    index.block_size = 16
    for _ in range(5):
        index.verify("a", 64, 0)
    index.expect("a", 0.0)
    index.sweep(2.0)
    index.heard("a")
    assert "a" not in index.live  # the self-check still distrusts it
    for _ in range(5):
        index.verify("a", 0, 0)
    assert "a" in index.live


def test_the_scheduler_starts_the_clock_for_legs_that_store_blocks_and_sweeps():
    now = [1000.0]
    s = scheduler(prefill_policy="kv-events", decode_policy="kv-events", kv_events_stale_secs=5)
    s._clock = lambda: now[0]
    p, d = endpoint("http://p:1", Role.PREFILL), endpoint("http://d:1")
    snapshot = Snapshot((p,), (d,))
    kv = s.kv_index
    for e in (p, d):
        name = instance_name(e.url, 0)
        kv.follow(name)
        event = stored(list(range(8)), None, IDS, 16, "map")  # each holds all 8 blocks
        kv.apply(name, decode_batch([0.0, [event], 0])[0])
    held = RequestFeatures(tokens=128.0, token_ids=IDS)
    s.schedule(held, snapshot)  # 7 blocks predicted of 8 whole ones: the 8th is stored
    assert kv.staleness.waiting_since(instance_name(p.url, 0)) == 1000.0
    kv.heard(instance_name(p.url, 0))
    kv.heard(instance_name(d.url, 0))
    short = RequestFeatures(tokens=15.0, token_ids=IDS[:15])  # no whole block: nothing stored
    s.schedule(short, snapshot)
    assert kv.staleness.waiting_since(instance_name(p.url, 0)) is None
    s.schedule(RequestFeatures(tokens=200.0, token_ids=list(range(200))), snapshot)
    now[0] += 5.0
    decision = s.schedule(short, snapshot)  # the sweep runs with each decision
    assert kv.live == set() and decision.prefill is p
    assert kv.staleness.stale == {instance_name(p.url, 0), instance_name(d.url, 0)}
