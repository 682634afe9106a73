"""The fault matrix for NIXL push (``--kv-connector nixl-push``, concurrent legs): every way a
prefill, a decode or a client can fail while a decode waits for its write, on a 2P2D fleet of
simulated push engines (engines/sim/connectors/nixl_push.py models vLLM 0.32's: the decode
waits for ever, and a decode aborted while it waits leaks its blocks until a prefill leg
with the same id and prompt finishes on the same prefill).

Each case ends like the rest of the matrix (``assert_settled``: a complete answer or a
correct error per request, counts back to 0, nothing left behind) and, beyond it, with every
decode's KV usage back to 0: no decode left waiting, none leaking."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.config.upstream import Timeouts
from tests.faults.harness import (
    TIMEOUTS,
    Fleet,
    all_ok,
    assert_settled,
    body,
    drive,
    fleet,
    wait_until,
)

pytestmark = pytest.mark.faults

ROUND_ROBIN = SchedulingConfig(prefill_policy="round-robin", decode_policy="round-robin")
# Past the prefill's answer a decode's KV comes within milliseconds: 1 s is long on a loaded
# machine and short enough for each case to resolve in a few seconds.
PUSH_TIMEOUTS = Timeouts(
    connect=TIMEOUTS.connect,
    read=TIMEOUTS.read,
    prefill=TIMEOUTS.prefill,
    decode_headers=TIMEOUTS.decode_headers,
    push_wait=1.0,
)


@contextlib.asynccontextmanager
async def push_fleet(**sim: Any) -> AsyncIterator[Fleet]:
    """2P2D push engines behind pdproxy sending every stream's legs at once, every prefill's
    coordinates learned (a serial request to each first)."""
    proxy = {
        "push_dispatch": "concurrent",
        "timeouts": PUSH_TIMEOUTS,
        # round robin: every fault below meets its engine within the first requests
        "scheduling": ROUND_ROBIN,
        **sim.pop("proxy", {}),
    }
    async with fleet(connector="nixl-push", proxy=proxy, **sim) as f:
        for i in range(40):  # round robin or load: each prefill answers one of them
            all_ok(await drive(f, 2, start=1000 + 2 * i, stream=True, concurrency=1))
            if f.state.orchestrator.push_status()["prefill_ranks_known"] == len(f.prefills):
                break
        assert f.state.orchestrator.push_status()["prefill_ranks_known"] == len(f.prefills)
        yield f


def concurrent_transfers(f: Fleet) -> float:
    return f.metric("pdproxy_push_transfers_total", dispatch="concurrent")


async def push_settled(f: Fleet) -> None:
    """The matrix's invariants, and no decode waiting or leaking: every decode's KV usage
    back to 0 and in rotation, no request id held, no heal pending."""
    await wait_until(
        lambda: all(d.gauges().kv_usage == 0 for d in f.decodes),
        timeout=8,
        what="every decode's KV usage back to 0",
    )
    push = f.state.orchestrator
    await wait_until(
        lambda: push.push_status()["healing"] == 0 and push.push_status()["request_ids_held"] == 0,
        timeout=8,
        what="no heal pending, no request id held",
    )
    await wait_until(
        lambda: not any(f.state.outliers.stranded(f.instance(d)) for d in f.decodes),
        timeout=5,
        what="no decode stranded",
    )
    await assert_settled(f)


async def test_concurrent_pushes_answer_every_request(caplog):
    async with push_fleet() as f:
        before = concurrent_transfers(f)
        caplog.set_level(logging.INFO, logger="pdproxy.access")
        all_ok(await drive(f, 16, stream=True))
        all_ok(await drive(f, 8, stream=False, start=100))  # whole answers: serial
        assert concurrent_transfers(f) - before == 16
        assert f.metric("pdproxy_push_transfers_total", dispatch="serial:whole-answer") == 8
        lines = [r.fields for r in caplog.records if r.name == "pdproxy.access"]
        pushes = sorted(line.get("push") for line in lines)
        assert pushes == ["concurrent"] * 16 + ["serial:whole-answer"] * 8  # the access line
        await push_settled(f)


async def test_a_prefill_5xx_strands_no_decode_for_good():
    """A prefill answering 5xx is sent the leg again (its decode waits on it); while it
    keeps failing the decode is stranded and the request served by another pair; once it
    answers again, the leg sent later frees the stranded decode's blocks."""
    async with push_fleet() as f:
        bad = f.prefills[0]
        bad.set_faults(status=500)
        all_ok(await drive(f, 12, stream=True))
        assert f.metric("pdproxy_push_heals_total", outcome="failed") >= 1
        assert sum(f.metric("pdproxy_push_stranded_total", instance=d.url) for d in f.decodes)
        bad.set_faults()
        await push_settled(f)
        assert f.metric("pdproxy_push_heals_total", outcome="healed_later") >= 1


async def test_a_hung_prefill_is_bounded_and_its_decode_healed_later():
    async with push_fleet() as f:
        bad = f.prefills[0]
        bad.set_faults(hang=True)
        all_ok(await drive(f, 8, stream=True))
        bad.set_faults()
        await push_settled(f)


async def test_a_refusing_prefill():
    async with push_fleet() as f:
        f.prefills[0].set_faults(refuse_connections=1.0)  # back after 1 s
        all_ok(await drive(f, 8, stream=True))
        await push_settled(f)


async def test_a_prefill_killed_before_it_writes():
    """The decodes registered with it wait for ever and leak (vLLM 0.32: no prefill leg can
    reach a registration its dead agent held): each is stranded, out of rotation and shown
    in /status, until it restarts (an operator's fix) and reads 0 again."""
    async with push_fleet() as f:
        bad = f.prefills[0]
        bad.set_faults(headers_delay_s=0.5)  # its legs are in flight when it dies
        outcomes = asyncio.create_task(drive(f, 8, stream=True))
        await asyncio.sleep(0.2)
        await bad.kill()
        all_ok(await outcomes)
        await bad.restart()
        stranded = [d for d in f.decodes if f.state.outliers.stranded(f.instance(d))]
        assert stranded, "no decode was left waiting on the killed prefill"
        async with aiohttp.ClientSession() as session, session.get(f.proxy.url + "/status") as r:
            rows = {i["url"]: i for i in (await r.json())["instances"]}
        assert all(rows[d.url]["stranded"] for d in stranded)
        assert all(d.gauges().kv_usage > 0 for d in stranded)  # the leak, as vLLM's
        all_ok(await drive(f, 8, stream=True, start=100))  # served by the others meanwhile
        for d in stranded:
            await d.restart()
        await push_settled(f)


async def test_a_refusing_decode():
    # Round robin (push_fleet): the first requests meet the refusing decode before its
    # health checks take it out (a load-aware pick could send them all to the other).
    async with push_fleet() as f:
        f.decodes[0].set_faults(refuse_connections=True)
        all_ok(await drive(f, 8, stream=True))
        assert f.metric("pdproxy_retries_total", leg="decode", reason="connect") >= 1
        f.decodes[0].set_faults()
        await wait_until(lambda: f.instance(f.decodes[0]).routable, timeout=5, what="back")
        await push_settled(f)


async def test_a_decode_killed_while_it_waits_for_its_write():
    async with push_fleet() as f:
        for p in f.prefills:  # the decodes wait while the prefills run
            p.set_faults(headers_delay_s=0.5)
        outcomes = asyncio.create_task(drive(f, 4, stream=True))
        await asyncio.sleep(0.2)
        await f.decodes[1].kill()
        all_ok(await outcomes)
        for p in f.prefills:
            p.set_faults()
        await f.decodes[1].restart()
        await push_settled(f)


async def _leave_after(f: Fleet, seconds: float, *, max_tokens: int = 6) -> None:
    async with aiohttp.ClientSession() as session:
        payload = body(0, stream=True, chat=False, max_tokens=max_tokens)
        task = asyncio.create_task(session.post(f.proxy.url + "/v1/completions", json=payload))
        await asyncio.sleep(seconds)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_client_that_leaves_before_the_prefill_answered_leaks_nothing():
    """The prefill leg is not cancelled (its write is what frees the waiting decode); the
    decode is closed once its KV came."""
    async with push_fleet() as f:
        for p in f.prefills:
            p.set_faults(headers_delay_s=0.5)
        await _leave_after(f, 0.2)
        for p in f.prefills:
            p.set_faults()
        await push_settled(f)
        finished = [r.outcome for p in f.prefills for r in p.generation_requests()]
        assert "client_disconnected" not in finished


async def test_a_client_that_leaves_after_its_first_token_leaks_nothing():
    async with push_fleet(decode_tps=50) as f:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(
                f.proxy.url + "/v1/completions",
                json=body(0, stream=True, chat=False, max_tokens=200),
            )
            await resp.content.readuntil(b"\n\n")
            resp.close()
        await push_settled(f)


async def test_two_requests_with_one_id_one_is_refused():
    async with push_fleet() as f:
        for p in f.prefills:
            p.set_faults(headers_delay_s=0.3)
        headers = {"X-Request-Id": "same-id-for-both"}
        async with aiohttp.ClientSession() as session:

            async def one(i: int) -> tuple[int, bytes]:
                payload = body(i, stream=True, chat=False)
                url = f.proxy.url + "/v1/completions"
                async with session.post(url, json=payload, headers=headers) as r:
                    return r.status, await r.read()

            first = asyncio.create_task(one(0))
            await asyncio.sleep(0.1)
            second = await one(1)
            status, _ = await first
        assert status == 200
        assert second[0] == 409 and b"ConflictError" in second[1]
        for p in f.prefills:
            p.set_faults()
        await push_settled(f)


async def test_a_prefill_restarted_under_the_same_engine_id():
    """vLLM's decodes keep the agent they met, so every push to the restarted prefill hangs
    (until the decodes restart): each request is answered or told in time, each decode that
    waited is stranded (out of rotation, /status says so) and the prefill blamed; restarted
    decodes serve again."""
    async with push_fleet(n_prefill=1, prefill_sim={"engine_id": "configured-prefill-id"}) as f:
        await f.prefills[0].restart()
        await wait_until(lambda: f.instance(f.prefills[0]).routable, timeout=3, what="back")
        outcomes = await drive(f, 6, stream=True)  # drive checks each is whole or an error
        assert all(o.seconds < 8 for o in outcomes)
        stranded = [d for d in f.decodes if f.state.outliers.stranded(f.instance(d))]
        assert stranded
        assert (
            f.metric(
                "pdproxy_endpoint_failures_total",
                role="prefill",
                url=f.prefills[0].url,
                reason="push_not_written",
            )
            >= 1
        )
        for d in f.decodes:
            await d.restart()
        await wait_until(
            lambda: all(f.instance(d).routable for d in f.decodes), timeout=3, what="decodes back"
        )
        all_ok(await drive(f, 6, stream=True, start=100))
        await push_settled(f)
