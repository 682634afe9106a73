"""The prefill leg of kv-events: a cached prefix against the queue, in tokens of work."""

import random

import pytest

from engines.sim.kv_events import stored
from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.proxying.leg_counts import enter, leave
from pdproxy.scheduling.context import RequestFeatures
from pdproxy.scheduling.kv_cost import PrefillCostScorer
from pdproxy.scheduling.kv_events import KVIndex, decode_batch
from pdproxy.scheduling.kv_keys import instance_name
from pdproxy.scheduling.kv_scorer import KVEventsScorer
from pdproxy.scheduling.policies import build_policy
from pdproxy.scheduling.prefix_index import PrefixIndex
from pdproxy.scheduling.scorers import PrefixScorer
from pdproxy.types import Role
from tests.unit.scheduling.helpers import ctx, endpoint

IDS = list(range(500, 628))  # 128 tokens, 8 blocks of 16: vLLM may hit 7 (112 tokens)
CONFIG = SchedulingConfig(balance_abs_threshold=2, balance_rel_threshold=1.5)


def _holds(index, url, blocks):
    name = instance_name(url, 0)
    index.follow(name)
    event = stored(list(range(blocks)), None, IDS[: blocks * 16], 16, "map")
    index.apply(name, decode_batch([0.0, [event], 0])[0])


def _features(ids=IDS):
    return RequestFeatures(tokens=float(len(ids)), token_ids=ids, blocks=(hash(tuple(ids)),))


def _fleet(kv, held=(8, 0), queued=(0.0, 0.0), slowness=(1.0, 1.0)):
    eps = [endpoint(f"http://p{i}:1", Role.PREFILL) for i in range(len(held))]
    for e, blocks, q, slow in zip(eps, held, queued, slowness, strict=True):
        _holds(kv, e.url, blocks)
        e.legs.queued_tokens = q
        e.speed.slowness = slow
    return eps


def _scorer(kv):
    return PrefillCostScorer(KVEventsScorer(kv, PrefixScorer(PrefixIndex(100))))


@pytest.mark.parametrize(
    ("queued", "slowness", "scores"),
    [
        # costs: holder 0 + 16 uncached, idle one 128
        ((0.0, 0.0), (1.0, 1.0), [1.0, 16 / 128]),
        # a queue of 100 tokens: 116 against 128, the hit still pays
        ((100.0, 0.0), (1.0, 1.0), [1.0, 116 / 128]),
        # a queue of 200: 216 against 128, the idle one is cheaper
        ((200.0, 0.0), (1.0, 1.0), [128 / 216, 1.0]),
        # a queue on the other one too: 216 against 128 + 100
        ((200.0, 100.0), (1.0, 1.0), [1.0, 216 / 228]),
        # the holder measured 10x slower: 160 against 128
        ((0.0, 0.0), (10.0, 1.0), [128 / 160, 1.0]),
        ((0.0, 0.0), (2.0, 1.0), [1.0, 32 / 128]),
    ],
)
def test_each_prefill_costs_its_queue_plus_the_uncached_prompt_times_its_slowness(
    queued, slowness, scores
):
    kv = KVIndex(1000)
    eps = _fleet(kv, queued=queued, slowness=slowness)
    assert _scorer(kv).score(ctx(_features()), eps) == pytest.approx(scores)


@pytest.mark.parametrize(
    ("weight", "scores"),
    [
        (1.0, [128 / 216, 1.0]),  # 200 + 16 against 128: the idle one
        (0.5, [1.0, 116 / 128]),  # 100 + 16 against 128: the holder
        (0.0, [1.0, 16 / 128]),  # the queue ignored: the hit alone
    ],
)
def test_the_queue_weighs_its_share(weight, scores):
    kv = KVIndex(1000)
    eps = _fleet(kv, queued=(200.0, 0.0))
    scorer = PrefillCostScorer(KVEventsScorer(kv, PrefixScorer(PrefixIndex(100))), weight)
    assert scorer.score(ctx(_features()), eps) == pytest.approx(scores)


def test_a_prompt_nobody_holds_scores_nothing_so_the_picker_spreads_it():
    kv = KVIndex(1000)
    eps = _fleet(kv, held=(0, 0, 0), queued=(0.0, 50.0, 0.0), slowness=(1.0, 1.0, 1.0))
    assert _scorer(kv).score(ctx(_features()), eps) == [0.0, 0.0, 0.0]


def test_a_partial_hit_saves_only_its_blocks():
    kv = KVIndex(1000)
    eps = _fleet(kv, held=(3, 5), queued=(0.0, 40.0))
    # 128 - 48 = 80 against 40 + 128 - 80 = 88
    assert _scorer(kv).score(ctx(_features()), eps) == pytest.approx([1.0, 80 / 88])


def test_without_token_ids_the_approximate_share_of_the_estimate_counts():
    kv = KVIndex(1000)
    approximate = PrefixIndex(100)
    eps = [endpoint(f"http://p{i}:1", Role.PREFILL) for i in range(2)]
    approximate.insert((1, 2, 3, 4), eps[0].url)  # all four character blocks
    approximate.insert((1, 2), eps[1].url)  # half of them
    eps[0].legs.queued_tokens = 150.0
    text = RequestFeatures(tokens=200.0, blocks=(1, 2, 3, 4))
    scorer = PrefillCostScorer(KVEventsScorer(kv, PrefixScorer(approximate)))
    # 150 + 0 against 0 + 100
    assert scorer.score(ctx(text), eps) == pytest.approx([100 / 150, 1.0])


def test_the_prefill_policy_weighs_the_queue_and_the_decode_policy_the_blocks():
    kv = KVIndex(1000)
    prefill = build_policy("kv-events", CONFIG, random.Random(0), kv, Role.PREFILL)
    decode = build_policy("kv-events", CONFIG, random.Random(0), kv, Role.DECODE)
    # the default queue weight's share of the queue + 16 uncached against 128
    share = CONFIG.kv_queue_weight
    eps = _fleet(kv, queued=(120.0 / share, 0.0))
    assert prefill.choose(ctx(_features()), eps) is eps[1]
    eps[0].legs.queued_tokens = 100.0 / share
    assert prefill.choose(ctx(_features()), eps) is eps[0]
    # A decode's held blocks are not a queue: the holder, unless overloaded.
    ds = _fleet(kv, queued=(500.0, 0.0))
    assert decode.choose(ctx(_features()), ds) is ds[0]
    ds[0].legs.work = 5.0  # 6 against 1: beyond both balance thresholds
    assert decode.choose(ctx(_features()), ds) is ds[1]


def test_the_overload_filter_runs_before_the_cost():
    kv = KVIndex(1000)
    prefill = build_policy("kv-events", CONFIG, random.Random(0), kv, Role.PREFILL)
    eps = _fleet(kv)
    eps[0].legs.work = 5.0  # few queued tokens, but many requests: filtered out
    assert prefill.choose(ctx(_features()), eps) is eps[1]


def test_prefill_legs_count_their_uncached_tokens_while_they_run():
    e = endpoint("http://p:1", Role.PREFILL)
    enter(e, None, 1.0, 100.0)
    enter(e, 0, 2.0, 30.5)
    assert e.legs.queued_tokens == 130.5
    leave(e, None, 1.0, 100.0)
    assert e.legs.queued_tokens == 30.5
    enter(e, None)  # a decode-sized leg: no prompt tokens
    leave(e, 0, 2.0, 30.5)
    assert e.legs.queued_tokens == 0.0
    leave(e, None)
    assert e.legs.queued_tokens == 0.0 and e.legs.in_flight == 0
