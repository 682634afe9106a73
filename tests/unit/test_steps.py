"""The orchestrator's optional steps: built at start-up only for the features that are on,
run at their hooks in the list's order, and a deployment without them runs none."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry

from pdproxy.build import build_state
from pdproxy.config.listener import AdmissionConfig
from pdproxy.config.lora import LoraConfig
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.tenants import TenantsConfig
from pdproxy.errors import Overloaded
from pdproxy.proxying.exchange import ProxyResponse
from pdproxy.proxying.steps import (
    DeadlineStep,
    FirstTokenStep,
    LegRoomStep,
    LoraStep,
    RequestStep,
    StepHooks,
)
from pdproxy.types import EngineAddress, Snapshot
from tests.unit.test_orchestrator import REQUEST, FakeLegs, _orchestrator

ADDRESSES = {
    "prefill": (EngineAddress(url="http://127.0.0.1:9"),),
    "decode": (EngineAddress(url="http://127.0.0.1:10"),),
}


def _steps(**config) -> list[type]:
    state = build_state(
        ProxyConfig(**ADDRESSES, **config), lambda: 0.0, CollectorRegistry(), random.Random(0)
    )
    return [type(step) for step in state.orchestrator.steps]


@pytest.mark.parametrize(
    ("config", "steps"),
    [
        ({}, []),
        ({"admission": AdmissionConfig(max_concurrent=8)}, []),  # a gate, no leg waits
        (
            {"admission": AdmissionConfig(max_concurrent=8, prefill_capacity=4)},
            [LegRoomStep],
        ),
        ({"tenants": TenantsConfig(header="x-tenant")}, [LegRoomStep, DeadlineStep]),
        ({"first_token_from_prefill": True}, [FirstTokenStep]),
        (
            {
                "lora": LoraConfig(modules=(("a", "/adapters/a"),), load_on_demand=True),
                "first_token_from_prefill": True,
            },
            [LoraStep, FirstTokenStep],
        ),
    ],
)
def test_each_feature_that_is_on_adds_its_step_and_only_it(config, steps):
    assert _steps(**config) == steps


class Recording(RequestStep):
    """Records each hook it is run at, with its name, in one shared list."""

    def __init__(self, name: str, seen: list[str], end: bool = False) -> None:
        self.name, self.seen, self.end = name, seen, end

    async def prepare(self, request, run):
        self.seen.append(f"{self.name}.prepare")

    async def before_prefill(self, request, run):
        self.seen.append(f"{self.name}.before_prefill")

    def view(self, snapshot):
        self.seen.append(f"{self.name}.view")
        return Snapshot(snapshot.prefill[-1:], snapshot.decode)  # the last prefill only

    def picked(self, request, decision, computed):
        self.seen.append(f"{self.name}.picked")

    async def before_decode(self, request, run, transfer, answer):
        self.seen.append(f"{self.name}.before_decode")

    def after_prefill(self, request, transfer, answer):
        self.seen.append(f"{self.name}.after_prefill")
        if self.end:
            return ProxyResponse(200, "application/json", "early", body=b"{}")
        return None

    def answered(self, response):
        self.seen.append(f"{self.name}.answered")


async def test_each_hook_runs_every_step_in_the_list_s_order():
    seen: list[str] = []
    legs = FakeLegs()
    orchestrator, _ = _orchestrator(legs, steps=(Recording("a", seen), Recording("b", seen)))
    assert (await orchestrator.handle(REQUEST)).status == 200
    hooks = ["prepare", "before_prefill", "view", "picked", "before_decode"]
    hooks += ["after_prefill", "answered"]
    assert seen == [f"{step}.{hook}" for hook in hooks for step in "ab"]
    assert legs.calls[0] == ("prefill", "http://p1:1")  # the view the steps left


async def test_a_response_after_the_prefill_ends_the_request_without_a_decode_leg():
    seen: list[str] = []
    legs = FakeLegs()
    steps = (Recording("a", seen, end=True), Recording("b", seen))
    orchestrator, _ = _orchestrator(legs, steps=steps)
    assert (await orchestrator.handle(REQUEST)).request_id == "early"
    assert [leg for leg, _ in legs.calls] == ["prefill"]
    assert seen[-2:] == ["b.before_decode", "a.after_prefill"]  # b's never asked, no answer


async def test_a_step_that_refuses_ends_the_request_before_any_leg():
    class Refusing(RequestStep):
        async def before_prefill(self, request, run):
            raise Overloaded("no room", retry_after=1)

    legs = FakeLegs()
    orchestrator, _ = _orchestrator(legs, steps=(Refusing(),))
    with pytest.raises(Overloaded):
        await orchestrator.handle(REQUEST)
    assert legs.calls == []


def test_only_the_steps_that_override_a_hook_are_run_at_it():
    class Closing(RequestStep):
        def close(self):
            pass

    closing, plain = Closing(), RequestStep()
    hooks = StepHooks((plain, closing))
    assert hooks.steps == (plain, closing) and hooks.close == (closing.close,)
    assert hooks.prepare == hooks.view == hooks.answered == ()


def test_push_is_a_leg_runner_chosen_at_start_up_not_a_step():
    def built(connector: str):
        config = ProxyConfig(**ADDRESSES, kv_connector=connector)
        return build_state(config, lambda: 0.0, CollectorRegistry(), random.Random(0))

    push, nixl = built("nixl-push").orchestrator, built("nixl").orchestrator
    assert push.steps == nixl.steps == ()
    assert push.push_status() is not None and nixl.push_status() is None
