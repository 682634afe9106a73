"""The fault matrix for requests a decode serves alone (``--pd-threshold-tokens``: every
prompt of the harness is short; ``--decode-only-fallback`` with no prefill left): the
same invariants as the two-leg path (harness.assert_settled), and no prefill touched."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from pdproxy.config.scheduling import SchedulingConfig
from tests.faults.harness import NO_MIGRATION, all_ok, assert_settled, body, drive, fleet

pytestmark = pytest.mark.faults

SHORT = {"scheduling": SchedulingConfig(pd_threshold_tokens=256)}  # the harness's prompts: ~20


def _sent(sims) -> int:
    return sum(len(s.generation_requests()) for s in sims)


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ({"refuse_connections": True}, "connect"),
        ({"status": 503}, "5xx"),
        ({"status": 429}, "429"),
        ({"headers_delay_s": 5.0}, "timeout"),
        ({"reset_after_bytes": 0}, "reset"),
    ],
    ids=["refused", "5xx", "429", "silent", "reset"],
)
async def test_a_failing_decode_is_retried_on_the_other(fault, reason):
    async with fleet(proxy=SHORT) as f:
        f.decodes[0].set_faults(**fault)
        all_ok(await drive(f, 12, stream=reason != "reset"))
        assert f.metric("pdproxy_retries_total", leg="decode", reason=reason) >= 1
        assert f.metric("pdproxy_decode_only_requests_total", reason="short_prompt") == 12
        assert _sent(f.prefills) == 0
        await assert_settled(f)


async def test_decode_killed_mid_stream_ends_with_one_error_event():
    async with fleet(proxy={**SHORT, **NO_MIGRATION}) as f:
        for d in f.decodes:
            d.set_faults(close_after_tokens=3)
        outcomes = await drive(f, 6, stream=True)
        assert all(o.status == 200 and o.error == "BadGatewayError" for o in outcomes)
        await assert_settled(f)


async def test_every_decode_down_is_a_fast_error():
    async with fleet(proxy=SHORT) as f:
        for d in f.decodes:
            d.set_faults(status=500)
        outcomes = await drive(f, 4, stream=False)
        assert all(o.status >= 500 and o.error for o in outcomes)
        assert _sent(f.prefills) == 0
        await assert_settled(f)


async def test_client_leaves_mid_stream():
    async with fleet(proxy=SHORT, decode_tps=50) as f:
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


async def test_client_leaves_while_the_decode_is_opening():
    async with fleet(proxy=SHORT) as f:
        for d in f.decodes:
            d.set_faults(headers_delay_s=0.5)
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(
                session.post(f.proxy.url + "/v1/completions", json=body(0, stream=True, chat=False))
            )
            await asyncio.sleep(0.2)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await assert_settled(f)


async def test_fallback_survives_losing_every_prefill_and_a_decode():
    fallback = {"scheduling": SchedulingConfig(decode_only_fallback=True)}
    async with fleet(proxy=fallback) as f:
        for p in f.prefills:
            await p.kill()
        await f.decodes[0].kill()
        all_ok(await drive(f, 12))
        assert f.metric("pdproxy_decode_only_requests_total", reason="no_prefill") >= 1
        await assert_settled(f)
