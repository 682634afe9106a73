"""The fault matrix on the token-in path (``/inference/v1/generate``): an engine that
refuses, answers 5xx or dies mid-stream, and a client that leaves, with the matrix's
invariants (``harness.assert_settled``)."""

from __future__ import annotations

import aiohttp
import pytest

from tests.faults.harness import GENERATE, NO_MIGRATION, all_ok, assert_settled, body, drive, fleet

pytestmark = pytest.mark.faults


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_refused_connections_are_retried(role):
    async with fleet() as f:
        bad = (f.prefills if role == "prefill" else f.decodes)[0]
        bad.set_faults(refuse_connections=True)
        all_ok(await drive(f, 12, generate=True))
        assert f.metric("pdproxy_retries_total", leg=role, reason="connect") >= 1
        await assert_settled(f)


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_a_4xx_is_relayed_never_retried(role):
    async with fleet() as f:
        for engine in f.prefills if role == "prefill" else f.decodes:
            engine.set_faults(status=400)
        outcomes = await drive(f, 8, generate=True)
        assert {o.status for o in outcomes} == {400}
        legs = [len(s.generation_requests()) for s in (*f.prefills, *f.decodes)]
        assert sum(legs) == 8 if role == "prefill" else 16  # one leg of each kind, no retry
        await assert_settled(f)


@pytest.mark.parametrize(("role", "status"), [("prefill", 500), ("decode", 503)])
async def test_5xx_is_retried_and_the_instance_ejected(role, status):
    async with fleet() as f:
        bad = (f.prefills if role == "prefill" else f.decodes)[0]
        bad.set_faults(status=status)
        all_ok(await drive(f, 16, generate=True))
        assert f.metric("pdproxy_retries_total", leg=role, reason="5xx") >= 1
        assert f.breaker(bad) in ("open", "half_open")
        await assert_settled(f)


async def test_decode_killed_mid_stream_ends_with_one_error_event():
    async with fleet(proxy=NO_MIGRATION) as f:
        for d in f.decodes:
            d.set_faults(close_after_tokens=3)
        outcomes = await drive(f, 6, stream=True, generate=True)
        assert all(o.status == 200 and o.error == "BadGatewayError" for o in outcomes)
        assert f.metric("pdproxy_retries_total", leg="decode", reason="reset") == 0
        await assert_settled(f)


async def test_client_leaves_mid_stream():
    async with fleet(decode_tps=50) as f:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(
                f.proxy.url + GENERATE,
                json=body(0, stream=True, chat=False, max_tokens=200, generate=True),
            )
            await resp.content.readuntil(b"\n\n")
            resp.close()
        await assert_settled(f)
        outcomes = [r.outcome for d in f.decodes for r in d.generation_requests()]
        assert outcomes == ["client_disconnected"]
