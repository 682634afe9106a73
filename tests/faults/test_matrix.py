"""The fault matrix: every way an engine or a client can fail, on a 2P2D fleet through a
real pdproxy. Each scenario asserts the same invariants (harness.assert_settled): a
complete answer or a correct OpenAI error for every request, none past its bound, never
an empty 200, every in-flight count back to 0, no connection or task left behind."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import MappingProxyType

import aiohttp
import pytest

from pdproxy.config.listener import AdmissionConfig
from pdproxy.config.proxy import SchedulingConfig
from pdproxy.config.resilience import RetryConfig
from pdproxy.config.tenants import TenantsConfig, TenantSpec
from tests.faults.harness import (
    HEALTH,
    NO_MIGRATION,
    all_ok,
    assert_settled,
    body,
    drive,
    fleet,
    wait_until,
)

pytestmark = pytest.mark.faults

ROUND_ROBIN_DECODES = SchedulingConfig(decode_policy="round-robin")


def _sent(sim) -> int:
    return len(sim.generation_requests())


# -- engines that refuse, reset or answer errors: retried on the other instance ----------


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_refused_connections_are_retried(role):
    async with fleet() as f:
        bad = (f.prefills if role == "prefill" else f.decodes)[0]
        bad.set_faults(refuse_connections=True)
        all_ok(await drive(f, 16))
        assert f.metric("pdproxy_retries_total", leg=role, reason="connect") >= 1
        await assert_settled(f)


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_reset_before_the_first_byte_is_retried(role):
    async with fleet() as f:
        bad = (f.prefills if role == "prefill" else f.decodes)[0]
        bad.set_faults(reset_after_bytes=5)  # a whole answer cut after 5 bytes
        all_ok(await drive(f, 16, stream=False))
        assert f.metric("pdproxy_retries_total", leg=role, reason="reset") >= 1
        await assert_settled(f)


@pytest.mark.parametrize(("role", "status"), [("prefill", 500), ("decode", 503)])
async def test_5xx_is_retried_and_the_instance_ejected(role, status):
    async with fleet() as f:
        bad = (f.prefills if role == "prefill" else f.decodes)[0]
        bad.set_faults(status=status)
        all_ok(await drive(f, 24))
        assert f.metric("pdproxy_retries_total", leg=role, reason="5xx") >= 1
        assert f.breaker(bad) in ("open", "half_open")
        assert f.metric("pdproxy_ejections_total", role=role, url=bad.url) >= 1
        await assert_settled(f)


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_429_is_retried_but_never_ejects(role):
    async with fleet() as f:
        bad = (f.prefills if role == "prefill" else f.decodes)[0]
        bad.set_faults(status=429)
        all_ok(await drive(f, 16))
        assert f.metric("pdproxy_retries_total", leg=role, reason="429") >= 1
        assert f.breaker(bad) == "closed"
        assert _sent(bad) <= 6  # its peers first while it sheds load, not half of 16
        await assert_settled(f)


async def test_prefill_4xx_is_relayed_never_retried_and_decode_untouched():
    async with fleet() as f:
        for p in f.prefills:
            p.set_faults(status=400)
        outcomes = await drive(f, 8)
        assert {o.status for o in outcomes} == {400}
        assert sum(_sent(p) for p in f.prefills) == 8  # one leg per request, no retry
        assert sum(_sent(d) for d in f.decodes) == 0
        assert all(f.breaker(p) == "closed" for p in f.prefills)
        await assert_settled(f)


async def test_decode_4xx_is_relayed_never_retried():
    async with fleet() as f:
        for d in f.decodes:
            d.set_faults(status=400)
        outcomes = await drive(f, 8)
        assert {o.status for o in outcomes} == {400}
        assert sum(_sent(d) for d in f.decodes) == 8
        assert f.metric("pdproxy_retries_total", leg="decode", reason="5xx") == 0
        await assert_settled(f)


# -- engines that hang: bounded by the leg timeouts, then retried --------------------------


async def test_hung_prefill_is_bounded_by_the_prefill_timeout_and_retried():
    async with fleet() as f:
        f.prefills[0].set_faults(hang=True)
        outcomes = await drive(f, 12)
        all_ok(outcomes)
        assert max(o.seconds for o in outcomes) < 1.0 + 2.0  # prefill timeout + the retry
        assert f.metric("pdproxy_retries_total", leg="prefill", reason="timeout") >= 1
        await assert_settled(f)


async def test_decode_silent_before_its_headers_is_retried():
    async with fleet() as f:
        f.decodes[0].set_faults(headers_delay_s=30)
        outcomes = await drive(f, 12, stream=True)
        all_ok(outcomes)
        assert f.metric("pdproxy_retries_total", leg="decode", reason="timeout") >= 1
        await assert_settled(f)


async def test_decode_hung_mid_stream_ends_with_one_error_event_in_time():
    async with fleet(proxy=NO_MIGRATION) as f:
        for d in f.decodes:
            d.set_faults(hang_after_tokens=2)
        outcomes = await drive(f, 4, stream=True)
        assert all(o.status == 200 and o.error == "GatewayTimeoutError" for o in outcomes)
        assert max(o.seconds for o in outcomes) < 2.0 + 2.0  # read timeout + watchdog tick
        await assert_settled(f)


# -- engines that die ---------------------------------------------------------------------


async def test_decode_killed_mid_stream_ends_with_one_error_event():
    async with fleet(proxy=NO_MIGRATION) as f:
        for d in f.decodes:
            d.set_faults(close_after_tokens=3)
        outcomes = await drive(f, 8, stream=True)
        assert all(o.status == 200 and o.error == "BadGatewayError" for o in outcomes)
        assert f.metric("pdproxy_retries_total", leg="decode", reason="reset") == 0
        await assert_settled(f)


async def test_decode_reset_before_its_first_chunk_is_retried():
    async with fleet() as f:
        f.decodes[0].set_faults(reset_after_bytes=0)
        all_ok(await drive(f, 12, stream=True))
        await assert_settled(f)


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_killed_instance_is_out_of_rotation_at_once(role):
    async with fleet() as f:
        dead = (f.prefills if role == "prefill" else f.decodes)[0]
        await dead.kill()
        all_ok(await drive(f, 24))
        all_ok(await drive(f, 24, start=100))  # a second batch: it stays out
        assert f.breaker(dead) != "closed" or f.instance(dead).health.probe.value != "healthy"
        await assert_settled(f)


async def test_killed_and_restarted_decode_is_back_within_one_health_interval():
    async with fleet() as f:
        dead = f.decodes[0]
        await dead.kill()
        all_ok(await drive(f, 16))
        await wait_until(lambda: not f.instance(dead).routable, timeout=3, what="unhealthy")
        await dead.restart()
        took = await wait_until(
            lambda: f.instance(dead).routable and f.breaker(dead) != "open",
            timeout=3,
            what="back in rotation",
        )
        assert took <= HEALTH.interval + HEALTH.timeout + 0.25
        before = _sent(dead)
        all_ok(await drive(f, 16, start=100))
        assert _sent(dead) > before
        await assert_settled(f)


async def test_failed_kv_load_reruns_the_pair():
    async with fleet() as f:
        f.decodes[0].set_faults(fail_kv_load=True)
        all_ok(await drive(f, 12, stream=False))
        assert f.metric("pdproxy_retries_total", leg="decode", reason="5xx") >= 1
        await assert_settled(f)


# -- health checks -------------------------------------------------------------------------


async def test_slow_health_check_takes_the_instance_out_and_back():
    async with fleet() as f:
        slow = f.decodes[0]
        slow.set_faults(health_delay_s=3)
        await wait_until(lambda: not f.instance(slow).routable, timeout=4, what="unhealthy")
        f.decodes[0].clear_requests()
        all_ok(await drive(f, 8))
        assert _sent(slow) == 0
        slow.clear_faults()
        await wait_until(lambda: f.instance(slow).routable, timeout=4, what="healthy again")
        await assert_settled(f)


async def test_failing_health_endpoint_is_not_routed_to():
    async with fleet() as f:
        sick = f.prefills[1]
        sick.set_faults(health_status=503)
        await wait_until(lambda: not f.instance(sick).routable, timeout=3, what="unhealthy")
        assert f.metric("pdproxy_endpoint_healthy", role="prefill", url=sick.url) in (0.0, 1.0)
        sick.clear_requests()
        all_ok(await drive(f, 8))
        assert _sent(sick) == 0
        await assert_settled(f)


async def test_flapping_instance_never_fails_a_request():
    async with fleet() as f:
        flappy = f.decodes[1]

        async def flap() -> None:
            for n in range(12):
                flappy.set_faults(refuse_connections=n % 2 == 0)
                await asyncio.sleep(0.1)
            flappy.clear_faults()

        flapping = asyncio.create_task(flap())
        all_ok(await drive(f, 40))
        await flapping
        await assert_settled(f)


# -- whole roles down: a fast, correct error, never a hang --------------------------------


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_whole_role_down_is_a_fast_503(role):
    async with fleet() as f:
        for sim in f.prefills if role == "prefill" else f.decodes:
            sim.set_faults(refuse_connections=True)
        started = time.monotonic()
        outcomes = await drive(f, 8)
        assert {o.status for o in outcomes} == {503}
        assert time.monotonic() - started < 3
        await assert_settled(f)


async def test_exhausted_retry_budget_fails_fast_instead_of_retrying():
    no_budget = RetryConfig(budget_ratio=0, budget_min_per_sec=0)
    async with fleet(proxy={"retry": no_budget}) as f:
        f.decodes[0].set_faults(status=503)
        outcomes = await drive(f, 8, concurrency=1)
        assert {o.status for o in outcomes} == {200, 503}
        assert f.metric("pdproxy_retries_total", leg="decode", reason="5xx") == 0
        assert f.metric("pdproxy_retry_budget_exhausted_total", leg="decode") >= 1
        await assert_settled(f)


async def test_max_retries_zero_is_the_old_behaviour():
    # round robin: every other request meets the failing decode until its ejection (after
    # three failed legs), so three of them fail; a random tie-break could pick it only once
    settings = {"retry": RetryConfig(max_retries=0), "scheduling": ROUND_ROBIN_DECODES}
    async with fleet(proxy=settings) as f:
        f.decodes[0].set_faults(status=503)
        outcomes = await drive(f, 8, concurrency=1, stream=False)
        assert [o.status for o in outcomes].count(503) >= 2
        await assert_settled(f)


# -- clients that leave --------------------------------------------------------------------


async def _leave_after(f, seconds: float, *, stream: bool) -> None:
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(
            session.post(f.proxy.url + "/v1/completions", json=body(0, stream=stream, chat=False))
        )
        await asyncio.sleep(seconds)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_client_leaves_during_the_prefill():
    async with fleet() as f:
        for p in f.prefills:
            p.set_faults(headers_delay_s=0.5)
        await _leave_after(f, 0.2, stream=True)
        await assert_settled(f)
        assert sum(_sent(d) for d in f.decodes) == 0


async def test_client_leaves_while_the_decode_is_opening():
    async with fleet() as f:
        for d in f.decodes:
            d.set_faults(headers_delay_s=0.5)
        await _leave_after(f, 0.2, stream=True)
        await assert_settled(f)
        assert f.state.metrics.registry.get_sample_value(
            "pdproxy_requests_total",
            {"endpoint": "/v1/completions", "outcome": "client_disconnected"},
        )


async def test_client_leaves_mid_stream():
    async with fleet(decode_tps=50) as f:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(
                f.proxy.url + "/v1/completions",
                json=body(0, stream=True, chat=False, max_tokens=200),
            )
            await resp.content.readuntil(b"\n\n")
            resp.close()
        await assert_settled(f)
        outcomes = [r.outcome for d in f.decodes for r in d.generation_requests()]
        assert outcomes == ["client_disconnected"]


# -- registration -------------------------------------------------------------------------


async def test_registered_decode_that_stops_heartbeating_mid_request():
    from tests.faults.registered import registered_fleet

    async with registered_fleet() as f:
        quiet = f.decodes[0]
        requests = asyncio.create_task(drive(f, 16, stream=True, max_tokens=20))
        await asyncio.sleep(0.1)
        quiet.pause_registration()
        all_ok(await requests)
        await wait_until(lambda: f.instance(quiet) is None, timeout=4, what="expired")
        quiet.clear_requests()
        all_ok(await drive(f, 8, start=100))
        assert _sent(quiet) == 0
        await assert_settled(f)


async def test_recovered_instance_is_confirmed_within_about_one_interval():
    """success_threshold 3 would cost three whole intervals; rechecks confirm it sooner."""
    health = dataclasses.replace(HEALTH, interval=1.0, success_threshold=3)
    async with fleet(proxy={"health": health}) as f:
        sick = f.decodes[0]
        sick.set_faults(health_status=503)
        await wait_until(lambda: not f.instance(sick).routable, timeout=4, what="unhealthy")
        sick.clear_faults()
        took = await wait_until(lambda: f.instance(sick).routable, timeout=4, what="healthy")
        assert took <= 1.0 + 2 * 0.25 + 0.5
        all_ok(await drive(f, 8))
        await assert_settled(f)


# -- flow control (issue 31): requests that wait in pdproxy for a slot ------------------

FLOW = {
    "admission": AdmissionConfig(max_concurrent=2, max_queued=64, queue_timeout=10),
    "tenants": TenantsConfig(
        tenants=MappingProxyType({"batch": TenantSpec(priority=5, max_concurrent=32)}),
        header="x-tenant",
    ),
}


async def _clients_leave_while_waiting(f, waiting, what: str) -> None:
    """Ten requests of the batch tenant; once ``waiting(f)`` holds, six of their clients
    give up (while they wait, or as they go); the four others are answered, then the room
    they held or waited for serves eight more, and every count is back to 0."""
    async with aiohttp.ClientSession() as s:
        tasks = [
            asyncio.create_task(
                s.post(
                    f.proxy.url + "/v1/completions",
                    json=body(i, stream=i % 2 == 0, chat=False),
                    headers={"x-tenant": "batch"},
                )
            )
            for i in range(10)
        ]
        await wait_until(lambda: waiting(f), timeout=5, what=what)
        for task in tasks[4:]:
            task.cancel()
        for task in tasks[:4]:
            async with await task as r:
                assert r.status == 200 and await r.read()
        await asyncio.gather(*tasks[4:], return_exceptions=True)
    all_ok(await drive(f, 8))
    await assert_settled(f)


async def test_queued_clients_that_leave_return_their_slots_and_tenants_shares():
    async with fleet(proxy=FLOW, decode_tps=40) as f:
        await _clients_leave_while_waiting(f, lambda f: f.state.admission.queued >= 6, "a queue")


async def test_an_engine_that_dies_while_requests_queue_for_the_fleet():
    async with fleet(proxy=FLOW, decode_tps=100) as f:
        driving = asyncio.create_task(drive(f, 24, concurrency=12))
        await wait_until(lambda: f.state.admission.queued >= 4, timeout=5, what="a queue")
        await f.decodes[0].kill()
        all_ok(await driving)  # each queued request is served on the live decode
        await assert_settled(f)


# Each leg's own wait (--prefill-capacity / --decode-capacity 1: two legs a role at once on
# the 2P2D fleet), no global limit: requests wait in pdproxy for an engine with room.
FLOW_LEGS = {
    "admission": AdmissionConfig(queue_timeout=10, prefill_capacity=1, decode_capacity=1),
    "tenants": FLOW["tenants"],
}


def _legs_waiting(f) -> int:
    return f.state.admission.book.status()["queued"]


async def test_clients_that_leave_while_their_legs_wait_for_room_leave_the_line():
    async with fleet(proxy=FLOW_LEGS, decode_tps=40) as f:
        await _clients_leave_while_waiting(f, lambda f: _legs_waiting(f) >= 5, "legs waiting")


async def test_an_engine_that_dies_while_legs_wait_for_room_on_its_role():
    async with fleet(proxy=FLOW_LEGS, decode_tps=100) as f:
        driving = asyncio.create_task(drive(f, 24, concurrency=12))
        await wait_until(lambda: _legs_waiting(f) >= 4, timeout=5, what="legs waiting")
        await f.decodes[0].kill()
        all_ok(await driving)  # each waiting leg is served on the live decode
        await assert_settled(f)


async def test_an_engine_that_hangs_while_legs_wait_answers_every_waiter_in_time():
    async with fleet(proxy=FLOW_LEGS, decode_tps=100) as f:
        f.decodes[0].set_faults(hang=True)
        outcomes = await drive(f, 12, concurrency=6)
        # the hung decode's legs time out (decode headers) and are retried on the other;
        # the waiters behind them go as those legs end: every request is answered
        all_ok(outcomes)
        f.decodes[0].clear_faults()
        await assert_settled(f)


async def test_a_decode_leg_that_waits_past_its_bound_is_a_429_and_frees_the_prefills_kv():
    # decodes of 1.5 s, one at a time each, and a leg may wait 0.3 s: the requests beyond
    # the two decoding finish their prefills, wait for a decode, and get 429; the KV each
    # prefill holds for them is released, not left for its lease.
    flow = {**FLOW_LEGS, "admission": AdmissionConfig(queue_timeout=0.3, decode_capacity=1)}
    async with fleet(proxy=flow, decode_tps=20) as f:
        outcomes = await drive(f, 6, concurrency=6, max_tokens=30)
        statuses = sorted(o.status for o in outcomes)
        assert set(statuses) == {200, 429} and statuses.count(429) >= 2, statuses
        for o in outcomes:
            if o.status == 429:
                assert b"no decode instance had room in time" in o.body
        refused = statuses.count(429)
        await wait_until(
            lambda: f.metric("pdproxy_released_kv_total", outcome="released") >= refused,
            timeout=5,
            what="the refused requests' KV released",
        )
        await assert_settled(f)
