"""Each policy on the pure pipeline: table-driven, endpoints with loads, expected picks."""

import random
from collections import Counter

import pytest

from pdproxy.config.scheduling import POLICIES, SchedulingConfig, canonical_policy
from pdproxy.errors import ConfigError
from pdproxy.scheduling.context import RequestFeatures
from pdproxy.scheduling.policies import POLICY_FACTORIES, build_policy
from pdproxy.types import Role
from tests.unit.scheduling.helpers import ctx, endpoint, with_load

CONFIG = SchedulingConfig(balance_abs_threshold=2, balance_rel_threshold=1.5)


def _policy(name, seed=0):
    return build_policy(name, CONFIG, random.Random(seed))


def test_every_policy_name_has_a_factory_and_aliases_resolve():
    assert set(POLICY_FACTORIES) == set(POLICIES)
    assert canonical_policy("cache_aware") == "prefix-affinity"
    assert canonical_policy("round_robin") == "round-robin"
    assert canonical_policy("POWER_OF_TWO") == "power-of-two"
    assert canonical_policy("consistent_hashing") == "consistent-hash"
    with pytest.raises(ConfigError, match="choose from"):
        canonical_policy("fastest")


def test_round_robin_cycles():
    eps = [endpoint(f"http://e{i}:1") for i in range(3)]
    p = _policy("round-robin")
    assert [p.choose(ctx(), eps).url for _ in range(6)] == [e.url for e in eps] * 2


def test_random_uses_every_instance():
    eps = [endpoint(f"http://e{i}:1") for i in range(3)]
    p = _policy("random")
    assert {p.choose(ctx(), eps).url for _ in range(60)} == {e.url for e in eps}


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ([3, 1, 2], "http://e1:1"),
        ([0, 5, 5], "http://e0:1"),
    ],
)
def test_least_loaded_picks_the_fewest_in_flight(loads, expected):
    eps = [endpoint(f"http://e{i}:1", in_flight=n) for i, n in enumerate(loads)]
    assert _policy("least-loaded").choose(ctx(), eps).url == expected


def test_least_loaded_trusts_fresh_engine_figures_and_ignores_stale_ones():
    busy_engine = with_load(endpoint("http://a:1"), running=4, waiting=6)
    stale = with_load(endpoint("http://b:1", in_flight=1), running=50, age=10)
    idle = endpoint("http://c:1", in_flight=2)
    assert _policy("least-loaded").choose(ctx(), [busy_engine, stale, idle]).url == "http://b:1"


def test_least_loaded_spreads_ties():
    eps = [endpoint(f"http://e{i}:1") for i in range(4)]
    p = _policy("least-loaded")
    assert len({p.choose(ctx(), eps).url for _ in range(80)}) == 4


def test_power_of_two_never_picks_the_single_busiest():
    eps = [endpoint(f"http://e{i}:1", in_flight=n) for i, n in enumerate([9, 1, 2, 3])]
    p = _policy("power-of-two")
    picks = Counter(p.choose(ctx(), eps).url for _ in range(300))
    assert picks["http://e0:1"] == 0 and len(picks) == 3
    assert picks["http://e1:1"] > picks["http://e3:1"]


def test_kv_aware_prefers_free_kv_then_fewer_requests():
    full = with_load(endpoint("http://full:1"), kv=0.9)
    free = with_load(endpoint("http://free:1"), running=1, kv=0.1)
    unknown = endpoint("http://unknown:1", in_flight=1)
    assert _policy("kv-aware").choose(ctx(), [full, free, unknown]).url == "http://free:1"


def test_consistent_hash_is_sticky_by_session_and_balances_without_one():
    eps = [endpoint(f"http://e{i}:1") for i in range(4)]
    p = _policy("consistent-hash")
    for session in ("a", "b", "c"):
        f = RequestFeatures(session=session)
        assert len({p.choose(ctx(f), eps).url for _ in range(20)}) == 1
    eps[2].legs.in_flight, eps[2].legs.work = 5, 5.0
    assert p.choose(ctx(), eps).url != "http://e2:1"


def test_prefix_affinity_follows_the_longest_prefix_unless_overloaded():
    p = _policy("prefix-affinity")
    eps = [endpoint(f"http://e{i}:1", Role.PREFILL) for i in range(3)]
    first = p.choose(ctx(RequestFeatures(blocks=(1, 2, 3))), eps)
    again = p.choose(ctx(RequestFeatures(blocks=(1, 2, 3, 4))), eps)
    assert again is first
    first.legs.in_flight, first.legs.work = 5, 5.0  # (5+1) > 1 + 2 and > 1 * 1.5: overloaded
    moved = p.choose(ctx(RequestFeatures(blocks=(1, 2, 3, 4, 5))), eps)
    assert moved is not first
    first.legs.in_flight, first.legs.work = 1, 1.0  # within the thresholds: affinity wins again
    assert p.choose(ctx(RequestFeatures(blocks=(1, 2, 9))), eps) in (first, moved)


def test_prefix_affinity_without_a_match_is_least_loaded():
    p = _policy("prefix-affinity")
    eps = [endpoint(f"http://e{i}:1", in_flight=n) for i, n in enumerate([2, 0, 1])]
    assert p.choose(ctx(RequestFeatures(blocks=(7,))), eps).url == "http://e1:1"


def test_model_filter_keeps_instances_serving_the_model_or_everyone():
    a = endpoint("http://a:1", models=["m1"])
    b = endpoint("http://b:1", models=["m2"], in_flight=3)
    p = _policy("least-loaded")
    assert p.choose(ctx(RequestFeatures(model="m2")), [a, b]) is b
    assert p.choose(ctx(RequestFeatures(model="m3")), [a, b]) is a  # nobody: the engine's 404


def test_prefix_affinity_ignores_a_match_under_the_cache_threshold():
    p = build_policy("prefix-affinity", SchedulingConfig(cache_threshold=0.3), random.Random(0))
    eps = [endpoint(f"http://e{i}:1", Role.PREFILL) for i in range(4)]
    holder = p.choose(ctx(RequestFeatures(blocks=(1, 2))), eps)
    # A new conversation sharing only the first of its 10 blocks (10 % < 30 %): by load.
    holder.legs.in_flight, holder.legs.work = 1, 1.0
    placed = {
        p.choose(ctx(RequestFeatures(blocks=(1, *range(100 + i, 109 + i)))), eps).url
        for i in range(0, 400, 10)
    }
    assert holder.url not in placed and len(placed) == 3
    # Sharing 3 of 4 blocks (75 %): affinity, despite the load.
    assert p.choose(ctx(RequestFeatures(blocks=(1, 2, 7, 8))), eps) is holder


def test_prefix_affinity_spreads_new_prefixes_over_idle_instances_of_unequal_speed():
    """The issue's thrash: idle, one prefill measured fastest; least-loaded sent every new
    tenant to it. Unmatched prompts now fill the caches in turn; a match still wins."""
    p = _policy("prefix-affinity")
    eps = [endpoint(f"http://e{i}:1", Role.PREFILL) for i in range(4)]
    eps[0].speed.slowness = 0.8
    for e in eps[1:]:
        e.speed.slowness = 1.1
    tenants = [tuple(range(100 * t, 100 * t + 8)) for t in range(8)]
    placed = Counter(p.choose(ctx(RequestFeatures(blocks=b)), eps).url for b in tenants)
    assert sorted(placed.values()) == [2, 2, 2, 2]
    first = p.choose(ctx(RequestFeatures(blocks=tenants[0])), eps)
    assert p.choose(ctx(RequestFeatures(blocks=(*tenants[0], 5))), eps) is first


def test_spreading_new_prefixes_never_picks_a_busier_instance():
    p = _policy("prefix-affinity")
    eps = [endpoint(f"http://e{i}:1", Role.PREFILL, in_flight=n) for i, n in enumerate([0, 1, 0])]
    placed = {p.choose(ctx(RequestFeatures(blocks=(1000 + i,))), eps).url for i in range(6)}
    assert placed == {"http://e0:1", "http://e2:1"}
