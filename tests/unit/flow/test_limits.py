"""Tenant limits (pdproxy.flow.limits), the tenants file (pdproxy.config.tenants) and who
a request is (pdproxy.flow.ticket)."""

from __future__ import annotations

import json

import pytest

from pdproxy.config.tenants import DEFAULT_TENANT, TenantsConfig, TenantSpec, load_tenants
from pdproxy.errors import BadRequest, ConfigError
from pdproxy.flow.limits import TenantLimits, duration
from pdproxy.flow.ticket import make_ticket


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _ticket(spec: TenantSpec, cost: float = 100.0, tenant: str = "t"):
    config = TenantsConfig(tenants={tenant: spec}, path="x")
    prompt = cost - 16
    return make_ticket(config, {"max_tokens": 16}, {}, tenant, prompt, 0.0)


def test_tokens_per_minute_refuse_after_the_minutes_allowance_then_refill():
    clock = Clock()
    limits = TenantLimits(clock)
    ticket = _ticket(TenantSpec(tokens_per_minute=1000))
    admitted = 0
    while limits.admit(ticket) is None:
        admitted += 1
        limits.release(ticket)
    assert admitted == 10
    refusal = limits.admit(ticket)
    assert refusal is not None and refusal.reason == "rate_limit"
    headers = dict(refusal.headers)
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    assert headers["x-ratelimit-remaining-tokens"] == "0"
    assert headers["x-ratelimit-reset-tokens"] == "1m0s"
    assert refusal.retry_after == 6  # 100 tokens at 1,000 a minute
    clock.now += 6.0
    assert limits.admit(ticket) is None


def test_requests_per_minute_and_concurrency():
    clock = Clock()
    limits = TenantLimits(clock)
    rpm = _ticket(TenantSpec(requests_per_minute=3))
    for _ in range(3):
        assert limits.admit(rpm) is None
    refusal = limits.admit(rpm)
    assert refusal is not None and dict(refusal.headers)["x-ratelimit-limit-requests"] == "3"
    conc = _ticket(TenantSpec(max_concurrent=2), tenant="c")
    assert limits.admit(conc) is None and limits.admit(conc) is None
    refusal = limits.admit(conc)
    assert refusal is not None and refusal.reason == "tenant_concurrency"
    limits.release(conc)
    assert limits.admit(conc) is None


def test_a_tenant_without_limits_costs_nothing_and_keeps_no_state():
    limits = TenantLimits(Clock())
    ticket = _ticket(TenantSpec(weight=2.0))
    for _ in range(1000):
        assert limits.admit(ticket) is None
    assert limits._tenants == {}


def test_a_reload_keeps_what_a_tenant_used_of_its_minute():
    clock = Clock()
    limits = TenantLimits(clock)
    ticket = _ticket(TenantSpec(requests_per_minute=5))
    for _ in range(5):
        assert limits.admit(ticket) is None
    assert limits.admit(ticket) is not None
    limits.reconfigure({"t": TenantSpec(requests_per_minute=10)})
    raised = _ticket(TenantSpec(requests_per_minute=10))
    for _ in range(5):  # 5 used of the new 10
        assert limits.admit(raised) is None
    assert limits.admit(raised) is not None


def test_reset_durations_are_spelled_as_openai_does():
    assert duration(0.02) == "20ms" and duration(1.0) == "1s" and duration(360.0) == "6m0s"
    assert duration(1.5) == "1.5s"


def _file(tmp_path, text, name="t.json"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_the_tenants_file_in_json_and_yaml(tmp_path):
    data = {"default": {"weight": 1}, "chat": {"weight": 3, "priority": -1}, "batch": None}
    config = load_tenants(_file(tmp_path, json.dumps(data)), "x-tenant")
    assert config.spec("chat") == TenantSpec(weight=3.0, priority=-1)
    assert config.spec("nobody") is config.default and config.known("nobody") == DEFAULT_TENANT
    yaml_text = "default: {requests_per_minute: 60}\nbatch:\n  priority: 10\n  weight: 0.5\n"
    config = load_tenants(_file(tmp_path, yaml_text, "t.yaml"))
    assert config.default.requests_per_minute == 60 and config.spec("batch").priority == 10


@pytest.mark.parametrize(
    ("text", "name", "says"),
    [
        ('{"a": {"weight": 1},\n "b": {"wieght": 2}}', "t.json", "unknown key 'wieght'"),
        ('{"a": {"weight": 0}}', "t.json", "weight must be a number in (0, 1e6]"),
        ('{"a": {"priority": "high"}}', "t.json", "priority must be an integer"),
        ('{"a": {"tokens_per_minute": -1}}', "t.json", "tokens_per_minute must be in"),
        ('{"a": 1}', "t.json", "its entry must be a mapping"),
        ('{"a b": {}}', "t.json", "tenant name 'a b'"),
        ('{"a": {\n"weight": 2,\n}}', "t.json", "at line 3"),
        ("a:\n  weight: [1,\n b: 2\n", "t.yaml", "at line"),
        ("[1, 2]", "t.json", "must map tenant names"),
    ],
)
def test_a_bad_tenants_file_says_where(tmp_path, text, name, says):
    with pytest.raises(ConfigError) as caught:
        load_tenants(_file(tmp_path, text, name))
    assert says in str(caught.value)


def test_who_a_request_is():
    config = TenantsConfig(
        tenants={"chat": TenantSpec(priority=-2), "batch": TenantSpec(priority=10)},
        header="x-tenant",
        path="f",
    )
    t = make_ticket(config, {"prompt": "x", "max_tokens": 50}, {"x-tenant": "batch"}, None, 8, 1.0)
    assert (t.tenant, t.priority, t.cost, t.deadline) == ("batch", 10, 58.0, None)
    own = make_ticket(config, {"priority": 3}, {"x-slo-ttft-ms": "250"}, "chat", 8, 1.0)
    assert (own.tenant, own.priority, own.deadline) == ("chat", 3, 1.25)  # the body's own wins
    assert make_ticket(config, {}, {"x-tenant": "nobody"}, None, 0, 0).tenant == DEFAULT_TENANT
    assert make_ticket(config, {}, {"x-tenant": "batch"}, "chat", 0, 0).tenant == "chat"


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        ({"priority": "1"}, {}),
        ({"priority": 1.5}, {}),
        ({"priority": True}, {}),
        ({"priority": 2**70}, {}),
        ({}, {"x-slo-ttft-ms": "soon"}),
        ({}, {"x-slo-ttft-ms": "-5"}),
        ({}, {"x-slo-ttft-ms": "nan"}),
        ({}, {"x-slo-ttft-ms": "inf"}),
        ({}, {"x-tenant": "a" * 200}),
        ({}, {"x-tenant": "%s%n\x00"}),
    ],
)
def test_bad_identity_is_a_400(body, headers):
    config = TenantsConfig(header="x-tenant")
    with pytest.raises(BadRequest):
        make_ticket(config, body, headers, None, 0, 0)
