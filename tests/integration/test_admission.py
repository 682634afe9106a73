"""Admission control: a burst past --max-concurrent-requests and its queue gets 429 with
Retry-After at once; queued requests wait in order and never past --queue-timeout-secs."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson

from pdproxy.config.listener import AdmissionConfig
from tests.integration.conftest import MODEL, deployment

BODY = {"model": MODEL, "prompt": "a burst of requests", "max_tokens": 10, "stream": True}


async def _timed(session, url, i):
    started = time.monotonic()
    async with session.post(url + "/v1/completions", json={**BODY, "user": str(i)}) as r:
        raw = await r.read()
        return r.status, r.headers.get("Retry-After"), raw, time.monotonic() - started


async def _burst(url, n):
    async with aiohttp.ClientSession() as s:
        return await asyncio.gather(*(_timed(s, url, i) for i in range(n)))


def _metric(d, name, **labels):
    return d.proxy.state.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_a_burst_past_the_limits_gets_429_at_once_and_the_queue_is_served():
    limits = AdmissionConfig(max_concurrent=2, max_queued=2, queue_timeout=5)
    async with deployment(1, 1, proxy={"admission": limits}, decode_tps=25) as d:
        results = await _burst(d.proxy.url, 8)
        served = [r for r in results if r[0] == 200]
        refused = [r for r in results if r[0] == 429]
        assert len(served) == 4 and len(refused) == 4  # 2 at once, 2 from the queue
        for _, retry_after, raw, seconds in refused:
            assert retry_after == "1" and seconds < 1.0  # at once, never a hang (5 s queue)
            assert orjson.loads(raw)["error"]["type"] == "RateLimitError"
        assert all(raw.rstrip().endswith(b"data: [DONE]") for _, _, raw, _ in served)
        assert _metric(d, "pdproxy_admission_rejected_total", reason="queue_full") == 4
        assert d.proxy.state.admission.active == 0 and d.proxy.state.admission.queued == 0


async def test_no_request_waits_past_the_queue_timeout():
    limits = AdmissionConfig(max_concurrent=1, max_queued=4, queue_timeout=0.2)
    async with deployment(1, 1, proxy={"admission": limits}, decode_tps=10) as d:
        results = await _burst(d.proxy.url, 5)  # 10 tokens at 10/s: the slot is held 1 s
        refused = [r for r in results if r[0] == 429]
        assert len(refused) == 4
        assert all(0.15 < seconds < 0.6 for *_, seconds in refused)
        assert _metric(d, "pdproxy_admission_rejected_total", reason="queue_timeout") == 4
        assert d.proxy.state.admission.active == 0


async def test_a_queued_client_that_leaves_frees_its_place():
    limits = AdmissionConfig(max_concurrent=1, max_queued=1, queue_timeout=5)
    async with deployment(1, 1, proxy={"admission": limits}, decode_tps=20) as d:
        async with aiohttp.ClientSession() as s:
            first = asyncio.create_task(_timed(s, d.proxy.url, 0))
            await asyncio.sleep(0.1)
            queued = asyncio.create_task(_timed(s, d.proxy.url, 1))
            await asyncio.sleep(0.1)
            assert d.proxy.state.admission.queued == 1
            queued.cancel()
            await asyncio.gather(queued, return_exceptions=True)
            for _ in range(50):
                if d.proxy.state.admission.queued == 0:
                    break
                await asyncio.sleep(0.01)
            assert d.proxy.state.admission.queued == 0
            assert (await _timed(s, d.proxy.url, 2))[0] == 200  # waited for the first slot
            assert (await first)[0] == 200
        assert d.proxy.state.admission.active == 0
