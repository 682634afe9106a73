"""Prefill compute contention (--prefill-concurrency) and per-DP-rank gauges."""

from __future__ import annotations

import asyncio
import time

import aiohttp

from engines.sim import SimConfig, running_sim
from tests.sim.helpers import COMPLETIONS, MODEL, post, wait_for

WORDS = 48  # one token per word
US_PER_TOKEN = 5000  # about 0.25 s of compute per prompt


def _body(word: str) -> dict[str, object]:
    """A prompt of its own (no shared prefix, so no cache hit) of WORDS tokens."""
    prompt = " ".join(f"{word}{i}" for i in range(WORDS))
    return {"model": MODEL, "prompt": prompt, "max_tokens": 1}


async def _timed(session: aiohttp.ClientSession, url: str, word: str) -> float:
    start = time.monotonic()
    status, raw = await post(session, url + COMPLETIONS, _body(word))
    assert status == 200, raw
    return time.monotonic() - start


async def _two_at_once(session: aiohttp.ClientSession, config: SimConfig) -> list[float]:
    async with running_sim(config) as sim:
        tasks = [asyncio.create_task(_timed(session, sim.url, w)) for w in ("alpha", "beta")]
        await wait_for(lambda: sim.gauges().running == 2)
        assert sim.gauges().waiting == 0  # queued for compute counts as running, as in vLLM
        return sorted(await asyncio.gather(*tasks))


async def test_one_lane_serialises_prefill_compute(session):
    config = SimConfig(prefill_us_per_token=US_PER_TOKEN, prefill_concurrency=1)
    first, second = await _two_at_once(session, config)
    compute = WORDS * US_PER_TOKEN / 1e6
    assert compute * 0.9 < first < compute * 3
    assert second > 2 * compute * 0.95  # waited for the first one's lane
    assert second > 1.6 * first


async def test_unlimited_lanes_compute_in_parallel(session):
    config = SimConfig(prefill_us_per_token=US_PER_TOKEN)
    first, second = await _two_at_once(session, config)
    assert second < 1.5 * first


def _series(name: str, rank: int) -> str:
    return f'{name}{{engine="{rank}",model_name="{MODEL}"}}'


async def test_gauges_per_dp_rank(session):
    config = SimConfig(dp_size=2, max_running=1, ttft_ms=10_000)
    async with running_sim(config) as sim:
        rank1 = {"X-data-parallel-rank": "1"}
        tasks = [
            asyncio.create_task(post(session, sim.url + COMPLETIONS, _body("a"))),
            asyncio.create_task(post(session, sim.url + COMPLETIONS, _body("b"), rank1)),
            asyncio.create_task(post(session, sim.url + COMPLETIONS, _body("c"), rank1)),
        ]
        await wait_for(lambda: sim.gauges().running == 2 and sim.gauges().waiting == 1)
        m = sim.metrics()
        assert m[_series("vllm:num_requests_running", 0)] == 1
        assert m[_series("vllm:num_requests_waiting", 0)] == 0
        assert m[_series("vllm:num_requests_running", 1)] == 1  # max_running is per rank
        assert m[_series("vllm:num_requests_waiting", 1)] == 1
        assert m[_series("vllm:kv_cache_usage_perc", 1)] > 0
        assert m["vllm:num_requests_running"] == 2  # the bare name sums the ranks
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await wait_for(lambda: sim.gauges().running == 0 and sim.gauges().waiting == 0)
        assert sim.metrics()[_series("vllm:kv_cache_usage_perc", 1)] == 0


async def test_one_rank_reports_engine_zero_only(session):
    async with running_sim(SimConfig()) as sim:
        text = sim.metrics_text()
    assert _series("vllm:num_requests_running", 0) in text
    assert 'engine="1"' not in text


async def _finish_order(session: aiohttp.ClientSession, policy: str) -> list[str]:
    config = SimConfig(max_running=1, decode_tps=50, scheduling_policy=policy)
    order: list[str] = []

    async def send(tag: str, priority: int) -> None:
        body = {"model": MODEL, "prompt": tag, "max_tokens": 5, "priority": priority}
        status, raw = await post(session, sim.url + COMPLETIONS, body)
        assert status == 200, raw
        order.append(tag)

    async with running_sim(config) as sim:
        tasks = [asyncio.create_task(send("first", 0))]
        await wait_for(lambda: sim.gauges().running == 1)
        for i in range(3):
            tasks.append(asyncio.create_task(send(f"batch{i}", 5)))
            await wait_for(lambda n=i + 1: sim.gauges().waiting == n)
        tasks.append(asyncio.create_task(send("urgent", -1)))
        await wait_for(lambda: sim.gauges().waiting == 4)
        await asyncio.gather(*tasks)
    return order


async def test_the_priority_policy_orders_the_waiting_queue_as_vllm_does(session):
    assert await _finish_order(session, "priority") == [
        "first",
        "urgent",
        "batch0",
        "batch1",
        "batch2",
    ]
    assert await _finish_order(session, "fcfs") == ["first", "batch0", "batch1", "batch2", "urgent"]
