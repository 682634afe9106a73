"""The kv-events policy: exact cached prefixes from engine events, on both legs, with the
approximate index for instances whose events are not followed."""

import random

from engines.sim.kv_events import stored
from pdproxy.config.scheduling import SchedulingConfig, canonical_policy
from pdproxy.scheduling.context import RequestFeatures
from pdproxy.scheduling.kv_events import KVIndex, decode_batch
from pdproxy.scheduling.kv_keys import instance_name
from pdproxy.scheduling.kv_scorer import predicted_tokens
from pdproxy.scheduling.policies import build_policy
from pdproxy.types import Role
from tests.unit.scheduling.helpers import ctx, endpoint

IDS = list(range(500, 628))  # 8 blocks of 16
CONFIG = SchedulingConfig(balance_abs_threshold=2, balance_rel_threshold=1.5)


def _holds(index, url, blocks, rank=0, tokens=IDS):
    name = instance_name(url, rank)
    index.follow(name)
    event = stored(list(range(blocks)), None, tokens[: blocks * 16], 16, "map")
    index.apply(name, decode_batch([0.0, [event], rank])[0])


def _features(ids=IDS):
    return RequestFeatures(tokens=float(len(ids)), token_ids=ids, blocks=(hash(tuple(ids)),))


def test_the_policy_name_and_llm_ds_spelling():
    assert canonical_policy("kv_events") == "kv-events"
    assert canonical_policy("precise-prefix-cache") == "kv-events"


def test_prefill_goes_where_the_events_say_the_prefix_is():
    kv = KVIndex(1000)
    policy = build_policy("kv-events", CONFIG, random.Random(0), kv)
    eps = [endpoint(f"http://p{i}:1", Role.PREFILL) for i in range(3)]
    for e in eps:
        _holds(kv, e.url, 0)  # followed, holding nothing yet
    _holds(kv, eps[2].url, 3)
    _holds(kv, eps[1].url, 5)
    assert policy.choose(ctx(_features()), eps) is eps[1]


def test_decode_leg_prefers_the_decode_already_holding_blocks():
    kv = KVIndex(1000)
    policy = build_policy("kv-events", CONFIG, random.Random(0), kv)
    eps = [endpoint(f"http://d{i}:1") for i in range(4)]
    for e in eps:
        kv.follow(instance_name(e.url, 0))
    _holds(kv, eps[3].url, 8)
    assert policy.choose(ctx(_features()), eps) is eps[3]


def test_an_evicted_prefix_is_not_followed_where_the_approximate_index_would():
    kv = KVIndex(1000)
    policy = build_policy("kv-events", CONFIG, random.Random(0), kv)
    eps = [endpoint(f"http://p{i}:1", Role.PREFILL) for i in range(2)]
    for e in eps:
        kv.follow(instance_name(e.url, 0))
    first = policy.choose(ctx(_features()), eps)  # the approximate index learns this
    other = eps[1] if first is eps[0] else eps[0]
    _holds(kv, other.url, 6)  # yet the engines say the other one holds it
    assert policy.choose(ctx(_features()), eps) is other


def test_instances_without_events_are_scored_by_the_approximate_index():
    kv = KVIndex(1000)
    policy = build_policy("kv-events", CONFIG, random.Random(0), kv)
    eps = [endpoint(f"http://p{i}:1", Role.PREFILL) for i in range(3)]
    kv.follow("http://elsewhere:1|0")
    first = policy.choose(ctx(_features()), eps)
    assert all(policy.choose(ctx(_features()), eps) is first for _ in range(5))
    # A token-less request (text, no --render-once): the approximate index alone.
    text = RequestFeatures(tokens=100.0, blocks=(1, 2, 3))
    again = policy.choose(ctx(text), eps)
    assert policy.choose(ctx(text), eps) is again


def test_predicted_tokens_are_vllms_hit_on_the_best_rank_never_the_whole_prompt():
    kv = KVIndex(1000)
    e = endpoint("http://p:1", Role.PREFILL, dp=2)
    assert predicted_tokens(ctx(_features()), kv, e) is None  # not followed
    _holds(kv, e.url, 2, rank=0)
    _holds(kv, e.url, 8, rank=1)
    assert predicted_tokens(ctx(_features()), kv, e) == 7 * 16  # 128 tokens: 127 at most
    assert predicted_tokens(ctx(_features(IDS[:100])), kv, e) == 6 * 16
    assert predicted_tokens(ctx(_features([1, *IDS[1:]])), kv, e) == 0


def test_a_prompt_shorter_than_a_block_scores_nothing_and_follows_no_one():
    kv = KVIndex(1000)
    policy = build_policy("kv-events", CONFIG, random.Random(0), kv)
    eps = [endpoint(f"http://p{i}:1", Role.PREFILL) for i in range(2)]
    for e in eps:
        _holds(kv, e.url, 1)
    assert policy.choose(ctx(_features(IDS[:16])), eps) in eps  # 15 tokens may hit: none
