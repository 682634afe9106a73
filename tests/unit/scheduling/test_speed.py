from pdproxy.scheduling.speed import SpeedTracker
from pdproxy.types import Role
from tests.unit.scheduling.helpers import ctx, endpoint, scheduler


def _prefills(n):
    return [endpoint(f"http://p{i}:1", Role.PREFILL) for i in range(n)]


def test_slowness_is_relative_to_the_role_and_starts_at_one():
    tracker = SpeedTracker()
    fast, slow, new = _prefills(3)
    for _ in range(30):
        for e in (fast, fast, fast):
            tracker.observe(e, 0.5, 512)
        tracker.observe(slow, 2.0, 512)
    assert new.speed.slowness == 1.0
    assert 2.5 < slow.speed.slowness / fast.speed.slowness < 4.5
    assert tracker.typical(Role.PREFILL) > 0 and tracker.typical(Role.DECODE) == 0


def test_tiny_prompts_count_as_a_minimum_size():
    tracker = SpeedTracker()
    a, b = _prefills(2)
    tracker.observe(a, 0.01, 1)
    tracker.observe(b, 0.01, 16)
    assert a.speed.seconds_per_token == b.speed.seconds_per_token


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
        tracker.observe(_prefills(1)[0], 0.1, 100)
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
