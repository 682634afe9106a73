"""Fault-matrix cases for admission control, the drain and client keys: the same fleet, the
same invariants (harness.assert_settled) as tests/faults/test_matrix.py."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from pdproxy.config.listener import AdmissionConfig
from tests.faults.harness import assert_settled, body, drive, fleet

pytestmark = pytest.mark.faults


async def test_admission_with_a_hung_decode_answers_everyone_in_time():
    """Slots held by requests stuck on a hung decode: the queue times out with 429 at
    once, nobody hangs, every slot comes back."""
    limits = AdmissionConfig(max_concurrent=4, max_queued=4, queue_timeout=0.3)
    async with fleet(proxy={"admission": limits}) as f:
        f.decodes[0].set_faults(headers_delay_s=30)
        outcomes = await drive(f, 24, concurrency=12, stream=True)
        statuses = {o.status for o in outcomes}
        assert statuses <= {200, 429} and 200 in statuses
        assert all(o.error is None for o in outcomes if o.status == 200)
        await assert_settled(f)
        assert f.state.admission.active == 0 and f.state.admission.queued == 0


async def test_drain_past_its_grace_with_hung_streams_and_waiting_requests():
    """A decode hung mid-stream and a prefill hung before its answer: the drain's end gives
    each stream one error event and each waiting request a 503, then nothing is left."""
    async with fleet() as f:
        for d in f.decodes:
            d.set_faults(hang_after_tokens=2)
        streams = asyncio.create_task(drive(f, 4, concurrency=4, stream=True, max_tokens=10))
        await asyncio.sleep(0.3)
        for p in f.prefills:
            p.set_faults(hang=True)
        waiting = asyncio.create_task(drive(f, 2, concurrency=2, stream=False, start=50))
        await asyncio.sleep(0.2)
        await f.state.lifecycle.drain(0.2)
        stream_outcomes, waiting_outcomes = await streams, await waiting
        assert all(
            o.status == 200 and o.error == "ServiceUnavailableError" for o in stream_outcomes
        )
        assert all(o.status == 503 for o in waiting_outcomes)
        refused = await drive(f, 2, start=90)
        assert {o.status for o in refused} == {503}
        await assert_settled(f)


async def test_wrong_keys_never_reach_a_failing_fleet():
    async with fleet(proxy={"api_keys": ("sk-right",)}) as f:
        for sim in f.engines:
            sim.set_faults(status=500)
        async with aiohttp.ClientSession() as s:
            for auth in (None, "Bearer sk-wrong"):
                headers = {"Authorization": auth} if auth else None
                async with s.post(
                    f.proxy.url + "/v1/completions",
                    json=body(0, stream=False, chat=False),
                    headers=headers,
                ) as r:
                    assert r.status == 401
        assert all(sim.generation_requests() == [] for sim in f.engines)
        await assert_settled(f)


async def test_keys_and_admission_on_the_happy_path():
    limits = AdmissionConfig(max_concurrent=8, max_queued=64, queue_timeout=5)
    async with fleet(proxy={"api_keys": ("sk-right",), "admission": limits}) as f:
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer sk-right"}) as s:
            for i in range(4):
                async with s.post(
                    f.proxy.url + "/v1/completions", json=body(i, stream=i % 2 == 0, chat=False)
                ) as r:
                    assert r.status == 200
                    assert (await r.read()).strip()
        await assert_settled(f)
