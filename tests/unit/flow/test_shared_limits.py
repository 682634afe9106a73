"""Tenants' limits shared by --workers processes through one file (pdproxy.flow.shared):
two TenantLimits on the same file are one set of limits."""

from __future__ import annotations

from pathlib import Path

from pdproxy.config.tenants import TenantSpec
from pdproxy.flow.limits import TenantLimits
from pdproxy.flow.shared import LimitsFile
from pdproxy.flow.ticket import Ticket


class _Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def _t(spec: TenantSpec, cost: float = 100.0, tenant: str = "metered") -> Ticket:
    return Ticket(tenant, spec, 0, cost, cost)


def _pair(tmp_path: Path, clock):
    path = str(tmp_path / "limits")
    a = TenantLimits(clock, LimitsFile(path, 0, 2))
    b = TenantLimits(clock, LimitsFile(path, 1, 2))
    return path, a, b


def test_a_tokens_per_minute_limit_holds_across_the_workers_exactly(tmp_path):
    clock = _Clock()
    _, a, b = _pair(tmp_path, clock)
    spec = TenantSpec(tokens_per_minute=1000)
    served_a = 0
    while a.admit(_t(spec)) is None:  # one worker takes the whole minute...
        served_a += 1
        a.release(_t(spec))
    assert served_a == 10
    refusal = b.admit(_t(spec))  # ...and the other has nothing left of it
    assert refusal is not None and refusal.reason == "rate_limit"
    assert dict(refusal.headers)["x-ratelimit-remaining-tokens"] == "0"
    clock.now += 6.0  # a tenth of a minute refills 100 tokens, for whichever worker
    assert b.admit(_t(spec)) is None
    assert a.admit(_t(spec)) is not None


def test_max_concurrent_counts_every_workers_requests_and_a_restart_forgets_its_own(tmp_path):
    clock = _Clock()
    path, a, b = _pair(tmp_path, clock)
    spec = TenantSpec(max_concurrent=3)
    assert a.admit(_t(spec)) is None and a.admit(_t(spec)) is None
    assert b.admit(_t(spec)) is None
    refused = b.admit(_t(spec))
    assert refused is not None and refused.reason == "tenant_concurrency"
    a.release(_t(spec))
    assert b.admit(_t(spec)) is None  # the room a freed is b's
    # worker 0 dies with one request in flight and restarts: its column starts at 0
    restarted = TenantLimits(clock, LimitsFile(path, 0, 2))
    assert restarted.admit(_t(spec)) is None  # 2 of b's + this one
    assert b.admit(_t(spec)) is not None


def test_a_limit_changed_by_a_reload_keeps_what_was_used(tmp_path):
    clock = _Clock()
    _, a, b = _pair(tmp_path, clock)
    old = TenantSpec(tokens_per_minute=1000)
    for _ in range(6):
        assert a.admit(_t(old)) is None
    new = TenantSpec(tokens_per_minute=2000)  # b reloaded first: 600 used of 2000
    served = 0
    while b.admit(_t(new)) is None:
        served += 1
    assert served == 14


def test_unlimited_tenants_never_touch_the_file_and_names_do_not_collide(tmp_path):
    clock = _Clock()
    _, a, b = _pair(tmp_path, clock)
    assert a.admit(_t(TenantSpec())) is None  # no limit: nothing charged anywhere
    spec = TenantSpec(requests_per_minute=2)
    for name in ("x", "y", "z" * 128):
        assert a.admit(_t(spec, tenant=name)) is None
        assert b.admit(_t(spec, tenant=name)) is None
        assert a.admit(_t(spec, tenant=name)) is not None
