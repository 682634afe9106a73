"""The fault-tolerance policies, pure: retry reasons, retry budget, backoff, outlier
ejection with its breaker, and active-health verdicts. Clocks and RNGs are injected."""

from __future__ import annotations

import random

import pytest

from pdproxy.config.resilience import HealthConfig, OutlierConfig
from pdproxy.errors import (
    BadRequest,
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamServerError,
    UpstreamStatusError,
    UpstreamTimeout,
)
from pdproxy.resilience.outlier import OutlierDetector, apply_probe
from pdproxy.resilience.retry import Backoff, RetryBudget, counts_against, retry_reason
from pdproxy.types import (
    BreakerState,
    Endpoint,
    EndpointHealth,
    EngineAddress,
    ProbeState,
    Role,
    Source,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _status(code: int) -> UpstreamStatusError:
    return UpstreamStatusError(leg="decode", status=code, body=b"{}", content_type="x")


@pytest.mark.parametrize(
    ("error", "reason", "instance_fault"),
    [
        (UpstreamConnectError("x", leg="decode"), "connect", True),
        (UpstreamTimeout("x", leg="prefill"), "timeout", True),
        (UpstreamProtocolError("x", leg="decode"), "reset", True),
        (UpstreamServerError(leg="prefill", status=503), "5xx", True),
        (_status(500), "5xx", True),
        (_status(429), "429", False),
        (_status(408), "408", False),
        (_status(400), None, False),
        (_status(404), None, False),
        (BadRequest("x"), None, False),
    ],
)
def test_retry_reason(error, reason, instance_fault):
    assert retry_reason(error) == reason
    assert (reason is not None and counts_against(reason)) is instance_fault


def test_budget_allows_the_ratio_plus_the_floor_and_forgets_old_requests():
    clock = Clock()
    budget = RetryBudget(ratio=0.2, window=10, min_per_sec=0.5, clock=clock)
    for _ in range(100):
        budget.on_request()
    allowed = sum(budget.try_spend() for _ in range(100))
    assert allowed == 20 + 5  # 20 % of 100, plus 0.5/s over 10 s
    clock.now += 11  # the window has passed: only the floor is left
    assert sum(budget.try_spend() for _ in range(100)) == 5


def test_budget_floor_alone_lets_a_quiet_proxy_retry():
    budget = RetryBudget(ratio=0.2, window=10, min_per_sec=1, clock=Clock())
    assert sum(budget.try_spend() for _ in range(50)) == 10


def test_backoff_grows_caps_and_jitters():
    backoff = Backoff(initial=0.05, maximum=1.0, multiplier=2.0, jitter=0.2)
    rng = random.Random(7)
    delays = [backoff.delay(n, rng) for n in range(8)]
    for n, delay in enumerate(delays):
        base = min(1.0, 0.05 * 2**n)
        assert 0.8 * base <= delay <= 1.2 * base
    assert Backoff(0.05, 1.0, 2.0, 0.0).delay(10, rng) == 1.0


def _endpoints(n: int, role: Role = Role.DECODE) -> list[Endpoint]:
    return [
        Endpoint.new(role=role, address=EngineAddress(url=f"http://e{i}:1"), source=Source.STATIC)
        for i in range(n)
    ]


def _detector(clock: Clock, **overrides) -> OutlierDetector:
    return OutlierDetector(OutlierConfig(**overrides), clock)


def test_three_failures_eject_and_the_time_doubles_up_to_the_cap():
    clock = Clock()
    det = _detector(clock, base_ejection=5, max_ejection=12)
    a, b = _endpoints(2)
    assert not det.on_failure(a, [a, b]) and not det.on_failure(a, [a, b])
    assert det.on_failure(a, [a, b])
    assert det.state(a) is BreakerState.OPEN and not det.available(a)
    clock.now += 5
    assert det.state(a) is BreakerState.HALF_OPEN and det.available(a)
    det.on_pick(a)  # the one trial
    assert not det.available(a)
    assert det.on_failure(a, [a, b])  # trial failed: ejected again, 10 s
    clock.now += 9.9
    assert not det.available(a)
    clock.now += 0.1
    det.on_pick(a)
    det.on_failure(a, [a, b])  # third ejection: 20 s capped at 12
    assert a.health.ejected_until == pytest.approx(clock.now + 12)
    assert a.health.ejections_total == 3


def test_a_successful_trial_restores_with_a_clean_record():
    clock = Clock()
    det = _detector(clock)
    a, b = _endpoints(2)
    for _ in range(3):
        det.on_failure(a, [a, b])
    clock.now += 5
    det.on_pick(a)
    det.on_success(a)
    assert det.state(a) is BreakerState.CLOSED and det.available(a)
    assert a.health.ejections == 0 and a.health.consecutive_failures == 0
    for _ in range(3):
        det.on_failure(a, [a, b])
    assert a.health.ejected_until == pytest.approx(clock.now + 5)  # base time again


def test_an_abandoned_trial_lets_the_next_one_through():
    clock = Clock()
    det = _detector(clock)
    a, b = _endpoints(2)
    for _ in range(3):
        det.on_failure(a, [a, b])
    clock.now += 5
    det.on_pick(a)
    det.on_abandoned(a)
    assert det.available(a)


def test_success_resets_the_consecutive_count():
    det = _detector(Clock())
    a, b = _endpoints(2)
    det.on_failure(a, [a, b])
    det.on_failure(a, [a, b])
    det.on_success(a)
    assert not det.on_failure(a, [a, b])
    assert det.state(a) is BreakerState.CLOSED


def test_never_the_last_instance_nor_past_the_percentage():
    det = _detector(Clock(), max_ejection_percent=50)
    (only,) = _endpoints(1)
    for _ in range(10):
        assert not det.on_failure(only, [only])
    a, b, c, d = _endpoints(4)
    fleet = [a, b, c, d]
    for e in (a, b, c):
        for _ in range(3):
            det.on_failure(e, fleet)
    ejected = [e for e in fleet if e.health.ejected_until is not None]
    assert ejected == [a, b]  # 50 % of 4


def test_disabled_detector_never_ejects():
    det = _detector(Clock(), consecutive_failures=0)
    a, b = _endpoints(2)
    for _ in range(10):
        assert not det.on_failure(a, [a, b])


def test_end_ejection_opens_the_trial_at_once():
    clock = Clock()
    det = _detector(clock)
    a, b = _endpoints(2)
    for _ in range(3):
        det.on_failure(a, [a, b])
    det.end_ejection(a)
    assert det.state(a) is BreakerState.HALF_OPEN and det.available(a)


def test_probe_verdicts_follow_the_thresholds():
    config = HealthConfig(failure_threshold=3, success_threshold=2)
    health = EndpointHealth(probe=ProbeState.UNKNOWN)
    assert apply_probe(health, True, config) is ProbeState.HEALTHY  # first answer suffices
    assert apply_probe(health, False, config) is None
    assert apply_probe(health, False, config) is None
    assert apply_probe(health, True, config) is None  # the run is broken
    for _ in range(2):
        assert apply_probe(health, False, config) is None
    assert apply_probe(health, False, config) is ProbeState.UNHEALTHY
    assert apply_probe(health, True, config) is None
    assert apply_probe(health, True, config) is ProbeState.HEALTHY


def test_an_instance_that_never_answered_turns_unhealthy():
    config = HealthConfig(failure_threshold=2)
    health = EndpointHealth(probe=ProbeState.UNKNOWN)
    assert apply_probe(health, False, config) is None
    assert apply_probe(health, False, config) is ProbeState.UNHEALTHY


def test_an_overloaded_instance_waits_out_its_cool_down_and_is_never_ejected():
    clock = Clock()
    det = _detector(clock, overload_cooldown=1.0)
    a, b = _endpoints(2)
    for _ in range(10):
        det.on_overloaded(a)
    assert not det.available(a) and det.state(a) is BreakerState.CLOSED
    clock.now += 1.0
    assert det.available(a)
    assert not _detector(clock, overload_cooldown=0).on_overloaded(b) and det.available(b)
