from pdproxy.scheduling.filters import OverloadFilter
from pdproxy.scheduling.speed import SpeedTracker, computed_tokens
from pdproxy.types import Role
from tests.unit.scheduling.helpers import ctx, endpoint, scheduler


def _prefills(n):
    return [endpoint(f"http://p{i}:1", Role.PREFILL) for i in range(n)]


def test_slowness_is_relative_to_the_role_and_starts_at_one():
    tracker = SpeedTracker()
    fast, slow, new = _prefills(3)
    for _ in range(30):
        for e in (fast, fast, fast):
            tracker.observe(e, 0.5, 512, 512)
        tracker.observe(slow, 2.0, 512, 512)
    assert new.speed.slowness == 1.0
    assert 2.5 < slow.speed.slowness / fast.speed.slowness < 4.5
    assert tracker.typical(Role.PREFILL) > 0 and tracker.typical(Role.DECODE) == 0


def _leg(tokens: float) -> float:
    """A typical prefill: 20 ms fixed, 0.5 ms a computed token."""
    return 0.02 + 0.0005 * tokens


def test_cache_hits_and_short_prompts_do_not_make_a_prefill_look_fast_or_slow():
    # Issue 31: a leg's seconds per whole-prompt token made a prefill that hit the cache
    # look 10-20x faster, one that got the 4-token warm-ups look slow. Per computed token,
    # against the role's fit of fixed + per-token cost, all three are as fast as each other.
    tracker = SpeedTracker()
    hits, warmups, misses = _prefills(3)
    for i in range(60):
        tracker.observe(hits, _leg(32), 512, 32)  # 480 of 512 tokens cached
        tracker.observe(warmups, _leg(4), 4, 4)
        tracker.observe(misses, _leg(512 + i % 7), 512 + i % 7, 512 + i % 7)
    for e in (hits, warmups, misses):
        assert 0.85 < e.speed.slowness < 1.15, (e.url, e.speed.slowness)
    assert abs(tracker.typical(Role.PREFILL) - 0.0005) < 0.0001


def test_a_slow_prefill_is_slow_whatever_it_was_sent():
    tracker = SpeedTracker()
    fast, slow = _prefills(2)
    for i in range(80):
        n = 16 + (i * 37) % 500
        tracker.observe(fast, _leg(n), n, n)
        tracker.observe(slow, 3 * _leg(n // 4), n, n // 4)  # mostly cached, 3x slower
    assert 2.3 < slow.speed.slowness < 3.7
    assert 0.8 < fast.speed.slowness < 1.2


def test_computed_tokens_come_from_the_prefills_own_answer():
    vllm = {"kv_transfer_params": {"remote_prefill_cached_tokens": 480}}
    assert computed_tokens(512, vllm) == 32
    openai = {"usage": {"prompt_tokens": 600, "prompt_tokens_details": {"cached_tokens": 100}}}
    assert computed_tokens(512, openai) == 500  # the prefill's own prompt count wins
    assert computed_tokens(512, {}, predicted_hit=256) == 256  # else the KV index's hit
    zero = {"kv_transfer_params": {"remote_prefill_cached_tokens": 0}, **openai}
    assert computed_tokens(512, zero) == 600  # a reported 0 is a miss, not "absent"
    for odd in (-5, 2**60, True, "480", 4.5, None, [480]):
        hostile = {"kv_transfer_params": {"remote_prefill_cached_tokens": odd}}
        assert computed_tokens(512, hostile) == 512
    assert computed_tokens(512, {"kv_transfer_params": {"remote_prefill_cached_tokens": 9999}}) == 0
    assert computed_tokens(512, {"usage": "x", "kv_transfer_params": []}) == 512


def test_the_overload_filter_never_drops_an_idle_prefill_for_its_past_slowness():
    # Issue 31: slowness stuck at 6 against a limit of 4.6 starved a prefill on a quiet
    # fleet: idle, it was dropped; never sent a leg, it was never measured again.
    busy, slow_idle, idle = _prefills(3)
    slow_idle.speed.slowness = 6.0
    busy.legs.in_flight, busy.legs.work = 1, 1.0
    survivors = OverloadFilter(abs_threshold=2.0, rel_threshold=1.5).filter(
        ctx(), [busy, slow_idle, idle]
    )
    assert slow_idle in survivors and idle in survivors
    busy.legs.in_flight, busy.legs.work = 8, 8.0  # a busy one is still dropped
    survivors = OverloadFilter(abs_threshold=2.0, rel_threshold=1.5).filter(
        ctx(), [busy, slow_idle, idle]
    )
    assert busy not in survivors and slow_idle in survivors


def test_a_slow_idle_prefill_gets_work_only_when_the_others_are_busier():
    s = scheduler(prefill_policy="least-loaded")
    fast, slow = _prefills(2)
    fast.speed.slowness, slow.speed.slowness = 1.0, 4.0
    assert s.prefill.choose(ctx(), [fast, slow]) is fast
    fast.legs.in_flight, fast.legs.work = 2, 2.0  # (2 + 1) * 1 < (0 + 1) * 4
    assert s.prefill.choose(ctx(), [fast, slow]) is fast
    fast.legs.in_flight, fast.legs.work = 4, 4.0  # (4 + 1) * 1 > 4
    assert s.prefill.choose(ctx(), [fast, slow]) is slow


def test_a_prefill_leg_weighs_by_its_prompt_size():
    tracker = SpeedTracker()
    assert tracker.weight(5000) == 1.0  # nothing measured yet
    for _ in range(40):
        tracker.observe(_prefills(1)[0], 0.1, 100, 100)
    assert abs(tracker.weight(100) - 1.0) < 0.01
    assert abs(tracker.weight(1200) - 12.0) < 0.2
    assert tracker.weight(1) == tracker.weight(16)  # tiny prompts count as a minimum
    assert tracker.weight(10**9) == 32.0


def test_least_loaded_sends_short_prompts_away_from_long_ones():
    s = scheduler(prefill_policy="least-loaded")
    busy_long, busy_short = _prefills(2)
    busy_long.legs.in_flight, busy_long.legs.work = 2, 24.0  # two prompts 12x the typical
    busy_short.legs.in_flight, busy_short.legs.work = 3, 3.0
    assert s.prefill.choose(ctx(), [busy_long, busy_short]) is busy_short
