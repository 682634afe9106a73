"""1P1D through a tiny driver (no proxy): output equals a single engine's only with the right KV."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from bench.fleet import metric_sum
from engines.sim import SimConfig, SimHandle, running_sim
from engines.sim.model import tokenize
from tests.sim.helpers import (
    CHAT,
    COMPLETIONS,
    body_for,
    decode,
    post,
    prefill,
    prefill_body,
    text_of,
    wait_for,
)

BLOCK = 4


@contextlib.asynccontextmanager
async def trio(connector: str, tmp_path: Path, **kw: Any) -> AsyncIterator[tuple[SimHandle, ...]]:
    """A prefill, a decode and a reference single engine."""
    common = dict(connector=connector, block_size=BLOCK, strict=True, **kw)
    kv_dir = str(tmp_path / "kv")
    async with (
        running_sim(SimConfig(role="prefill", kv_dir=kv_dir, **common)) as p,
        running_sim(SimConfig(role="decode", kv_dir=kv_dir, **common)) as d,
        running_sim(SimConfig(role="both", block_size=BLOCK)) as single,
    ):
        yield p, d, single


def test_example_prompt_hits_the_shared_store():
    # ExampleConnector keys: P stores ((N-1)//bs)*bs tokens, D looks up ((N-2)//bs)*bs
    n = len(tokenize(body_for(COMPLETIONS)["prompt"]))
    assert (n - 1) // BLOCK == (n - 2) // BLOCK and n > BLOCK + 1


@pytest.mark.parametrize("connector", ["nixl", "example"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [False, True])
async def test_1p1d_equals_single_engine(session, tmp_path, connector, path, stream):
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    body = body_for(path, 10, **extra)
    async with trio(connector, tmp_path) as (p, d, single):
        _, raw = await post(session, single.url + path, body)
        expected = text_of(raw, stream)
        params = await prefill(session, p.url, path, body)
        if connector == "nixl":
            assert params is not None and params["remote_engine_id"] == p.engine_id
            assert params["remote_port"] == p.kv_port
            assert p.gauges().kv_usage > 0
        else:
            assert params is None
        assert await decode(session, d.url, path, body, params) == expected
        assert p.counters.kv_bytes_sent > 0 and p.counters.kv_transfers == 1
        assert d.counters.kv_bytes_received == p.counters.kv_bytes_sent
        assert d.counters.tokens_external_kv_transfer > 0
        assert p.gauges().kv_usage == 0.0
        assert p.counters.contract_violations == 0 and d.counters.kv_load_failures == 0


async def test_decode_loads_only_the_blocks_its_prefix_cache_lacks(session, tmp_path):
    """As vLLM's decode: blocks already in its prefix cache are not loaded; what it
    received is cached, so the same prompt again loads only its last (never-hit) block."""
    body = body_for(COMPLETIONS, 4)
    n = len(tokenize(body["prompt"]))
    whole, hit = -(-n // BLOCK), (n - 1) // BLOCK
    async with trio("nixl", tmp_path) as (p, d, _single):
        first = await decode(
            session, d.url, COMPLETIONS, body, await prefill(session, p.url, COMPLETIONS, body)
        )
        assert (d.counters.kv_blocks_loaded, d.counters.kv_blocks_local_hit) == (whole, 0)
        again = await decode(
            session, d.url, COMPLETIONS, body, await prefill(session, p.url, COMPLETIONS, body)
        )
        assert again == first
        assert d.counters.kv_blocks_local_hit == hit
        assert d.counters.kv_blocks_loaded == 2 * whole - hit
        async with session.get(d.url + "/metrics") as r:
            text = await r.text()
    assert metric_sum(text, "sim_kv_blocks_loaded_total") == 2 * whole - hit
    assert metric_sum(text, "sim_kv_blocks_local_hit_total") == hit


async def test_nixl_params_follow_vllm(session, tmp_path):
    async with trio("nixl", tmp_path) as (p, _d, _single):
        params = await prefill(session, p.url, COMPLETIONS, body_for(COMPLETIONS))
        rid = p.generation_requests()[0].headers.get("x-request-id")
    assert rid is None
    assert params is not None
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_request_id"].startswith("cmpl-")
    assert len(params["remote_request_id"].rsplit("-", 1)[1]) == 8
    n = len(tokenize(body_for(COMPLETIONS)["prompt"]))
    assert params["remote_num_tokens"] == n
    assert len(params["remote_block_ids"][0]) == -(-n // BLOCK)
    assert params["transfer_mode"] == "pull" and params["tp_size"] == 1
    assert params["remote_host"] == "127.0.0.1"


async def test_swapped_params_never_silently_succeed(session, tmp_path):
    a = body_for(COMPLETIONS, 10)
    b = {**a, "prompt": a["prompt"].replace("quick", "slow")}  # same length, other KV
    async with trio("nixl", tmp_path) as (p, d, single):
        _, raw = await post(session, single.url + COMPLETIONS, a)
        expected_a = text_of(raw, False)
        await prefill(session, p.url, COMPLETIONS, a)
        params_b = await prefill(session, p.url, COMPLETIONS, b)
        # D serves request a with b's params: it loads b's KV and the words differ
        assert await decode(session, d.url, COMPLETIONS, a, params_b) != expected_a
        assert d.counters.tokens_external_kv_transfer > 0


async def test_wrong_engine_id_is_a_load_failure(session, tmp_path):
    body = body_for(COMPLETIONS, 10)
    async with trio("nixl", tmp_path) as (p, d, single):
        _, raw = await post(session, single.url + COMPLETIONS, body)
        params = await prefill(session, p.url, COMPLETIONS, body)
        assert params is not None
        bad = {**params, "remote_engine_id": "not-the-prefill"}
        assert await decode(session, d.url, COMPLETIONS, body, bad) == text_of(raw, False)
        assert d.counters.kv_load_failures == 1
        assert d.counters.tokens_external_kv_transfer == 0
        assert d.counters.tokens_local_compute == len(tokenize(body["prompt"]))
        assert d.metrics()["sim_kv_load_failures_total"] == 1
        assert p.gauges().kv_usage > 0  # still held: nobody pulled it


async def test_decode_without_params_recomputes(session, tmp_path):
    body = body_for(COMPLETIONS, 10)
    async with trio("nixl", tmp_path) as (_p, d, single):
        _, raw = await post(session, single.url + COMPLETIONS, body)
        assert await decode(session, d.url, COMPLETIONS, body, None) == text_of(raw, False)
        metrics = d.metrics()
    key = 'vllm:prompt_tokens_by_source_total{engine="0",model_name="sim-model",source="%s"}'
    assert metrics[key % "local_compute"] == len(tokenize(body["prompt"]))
    assert metrics[key % "external_kv_transfer"] == 0


async def test_invalid_params_recompute(session, tmp_path):
    body = body_for(COMPLETIONS, 4)
    async with trio("nixl", tmp_path) as (_p, d, _single):
        await decode(session, d.url, COMPLETIONS, body, {"do_remote_prefill": True})
        assert d.counters.kv_invalid_params == 1 and d.counters.tokens_local_compute > 0


async def test_lease_expiry_frees_blocks(session, tmp_path):
    body = body_for(COMPLETIONS)
    async with trio("nixl", tmp_path, kv_lease_s=0.3) as (p, d, _single):
        params = await prefill(session, p.url, COMPLETIONS, body)
        assert p.metrics()["vllm:kv_cache_usage_perc"] > 0
        await wait_for(lambda: p.gauges().kv_usage == 0.0, timeout=2.0)
        assert p.counters.kv_leases_expired == 1
        await decode(session, d.url, COMPLETIONS, body, params)  # too late: recompute
        assert d.counters.kv_load_failures == 1 and p.counters.kv_bytes_sent == 0


async def test_blocks_are_pulled_once(session, tmp_path):
    body = body_for(COMPLETIONS)
    async with trio("nixl", tmp_path) as (p, d, _single):
        params = await prefill(session, p.url, COMPLETIONS, body)
        await decode(session, d.url, COMPLETIONS, body, params)
        await decode(session, d.url, COMPLETIONS, body, params)
        assert d.counters.kv_transfers == 1 and d.counters.kv_load_failures == 1


@pytest.mark.parametrize(
    "change",
    [{"max_tokens": 5}, {"stream": True}, {"max_completion_tokens": 3}],
)
async def test_strict_rejects_unclamped_prefill(session, tmp_path, change):
    async with trio("nixl", tmp_path) as (p, _d, _single):
        status, raw = await post(
            session, p.url + COMPLETIONS, {**prefill_body(body_for(COMPLETIONS)), **change}
        )
        assert status == 400 and b"contract violation" in raw
        assert p.counters.contract_violations == 1
        assert p.gauges().kv_usage == 0.0


async def test_lenient_counts_violation_and_serves(session, tmp_path):
    async with running_sim(SimConfig(role="prefill")) as p:
        status, _ = await post(session, p.url + COMPLETIONS, body_for(COMPLETIONS, 3))
        assert status == 200 and p.counters.contract_violations == 1


async def test_concurrent_pairs(session, tmp_path):
    async with trio("nixl", tmp_path) as (p, d, single):
        bodies = [
            {**body_for(COMPLETIONS, 6), "prompt": f"request number {i} says hello"}
            for i in range(20)
        ]

        async def one(body: dict[str, Any]) -> str:
            params = await prefill(session, p.url, COMPLETIONS, body)
            return await decode(session, d.url, COMPLETIONS, body, params)

        got = await asyncio.gather(*(one(b) for b in bodies))
        want = [
            text_of((await post(session, single.url + COMPLETIONS, b))[1], False) for b in bodies
        ]
        assert got == want and d.counters.kv_transfers == 20
