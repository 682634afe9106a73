"""Timing, capacity, prefix cache and client disconnects."""

from __future__ import annotations

import asyncio
import time

import orjson

from engines.sim import SimConfig, running_sim
from tests.sim.helpers import COMPLETIONS, body_for, post, wait_for


async def test_ttft_and_decode_rate(session):
    async with running_sim(SimConfig(ttft_ms=100, decode_tps=100)) as sim:
        start = time.monotonic()
        await post(session, sim.url + COMPLETIONS, body_for(COMPLETIONS, 11))
        elapsed = time.monotonic() - start
    assert 0.19 < elapsed < 1.0  # 100 ms to the first token, then 10 x 10 ms


async def test_max_running_queues(session):
    async with running_sim(SimConfig(ttft_ms=200, max_running=1)) as sim:
        tasks = [
            asyncio.create_task(post(session, sim.url + COMPLETIONS, body_for(COMPLETIONS)))
            for _ in range(2)
        ]
        await wait_for(lambda: sim.gauges().running == 1 and sim.gauges().waiting == 1)
        metrics = sim.metrics()
        assert metrics["vllm:num_requests_waiting"] == 1
        assert metrics["vllm:num_requests_running"] == 1
        assert metrics["vllm:kv_cache_usage_perc"] > 0
        await asyncio.gather(*tasks)
        assert sim.gauges().running == 0 and sim.gauges().kv_usage == 0


async def test_prefix_cache_skips_prefill_time(session):
    async with running_sim(SimConfig(block_size=4, prefill_us_per_token=20000)) as sim:
        start = time.monotonic()
        _, first = await post(session, sim.url + COMPLETIONS, body_for(COMPLETIONS, 3))
        cold = time.monotonic() - start
        start = time.monotonic()
        _, second = await post(session, sim.url + COMPLETIONS, body_for(COMPLETIONS, 3))
        warm = time.monotonic() - start
        hits = sim.metrics()["vllm:prefix_cache_hits_total"]
    cached = orjson.loads(second)["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert orjson.loads(first)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cached == 12 and hits == 12  # 14 prompt tokens: 3 full blocks, the last never cached
    assert warm < cold / 2
    assert orjson.loads(first)["choices"] == orjson.loads(second)["choices"]


async def test_disconnect_while_computing_non_streaming(session):
    async with running_sim(SimConfig(ttft_ms=5000)) as sim:
        task = asyncio.create_task(post(session, sim.url + COMPLETIONS, body_for(COMPLETIONS)))
        await wait_for(lambda: sim.gauges().running == 1)
        task.cancel()
        closed_at = time.time()
        await asyncio.gather(task, return_exceptions=True)
        record = sim.generation_requests()[0]
        await wait_for(lambda: record.outcome == "client_disconnected")
        assert (record.disconnected_at or 0) - closed_at < 0.05
        assert sim.counters.client_disconnects == 1 and sim.gauges().running == 0


async def test_disconnect_mid_stream_stops_generation(session):
    async with running_sim(SimConfig(decode_tps=50)) as sim:
        body = body_for(COMPLETIONS, 500, stream=True)
        resp = await session.post(sim.url + COMPLETIONS, json=body)
        await resp.content.readuntil(b"\n\n")
        resp.close()
        closed_at = time.time()
        record = sim.generation_requests()[0]
        await wait_for(lambda: record.outcome == "client_disconnected")
        assert (record.disconnected_at or 0) - closed_at < 0.05
        generated = sim.counters.generation_tokens
        await asyncio.sleep(0.1)
        assert sim.counters.generation_tokens == generated < 20
        assert sim.metrics()["sim_client_disconnects_total"] == 1
