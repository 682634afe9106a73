"""--lora-load-on-demand: an adapter no pair holds is loaded on one pair before the legs,
that pair keeps its traffic, concurrent requests share one load, and --max-loras evicts
the adapter requested longest ago."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import orjson

from engines.sim import SimConfig, SimHandle, running_sim
from pdproxy.config.lora import LoraConfig
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.resilience import HealthConfig
from pdproxy.types import EngineAddress
from tests.servers import RunningProxy, running_proxy

BASE = "base"
MODULES = (("sql", "/adapters/sql"), ("kw", "/adapters/kw"))


@contextlib.asynccontextmanager
async def fleet(
    max_loras: int = 0, engine_api_key: str | None = None
) -> AsyncIterator[tuple[RunningProxy, list[SimHandle]]]:
    async with contextlib.AsyncExitStack() as stack:
        sims = [
            await stack.enter_async_context(
                running_sim(SimConfig(role=role, model=BASE, strict=True))
            )
            for role in ("prefill", "prefill", "decode", "decode")
        ]
        config = ProxyConfig(
            prefill=tuple(EngineAddress(url=s.url) for s in sims[:2]),
            decode=tuple(EngineAddress(url=s.url) for s in sims[2:]),
            health=HealthConfig(models_interval=0.05),
            lora=LoraConfig(modules=MODULES, load_on_demand=True, max_loras=max_loras),
            engine_api_key=engine_api_key,
        )
        proxy = await stack.enter_async_context(running_proxy(config))
        for _ in range(400):
            if BASE in proxy.state.registry.pools().by_model:
                break
            await asyncio.sleep(0.01)
        yield proxy, sims


def _holding(sims: list[SimHandle], name: str) -> list[int]:
    return [i for i, s in enumerate(sims) if name in s._server.app.served.adapters]


async def _complete(session: aiohttp.ClientSession, url: str, model: str) -> tuple[int, dict]:
    body = {"model": model, "prompt": "tell me about the river", "max_tokens": 5}
    async with session.post(url + "/v1/completions", json=body) as r:
        return r.status, orjson.loads(await r.read())


async def test_an_adapter_is_loaded_on_one_pair_which_keeps_its_traffic() -> None:
    async with (
        fleet() as (proxy, sims),
        running_sim(SimConfig(model=BASE, lora_modules=("sql=/adapters/sql",))) as single,
        aiohttp.ClientSession() as session,
    ):
        results = await asyncio.gather(*(_complete(session, proxy.url, "sql") for _ in range(4)))
        _, expected = await _complete(session, single.url, "sql")
        for status, answer in results:
            assert status == 200, answer
            assert answer["choices"][0]["text"] == expected["choices"][0]["text"]
        holders = _holding(sims, "sql")
        assert len(holders) == 2 and holders[0] < 2 <= holders[1]  # one prefill, one decode
        assert proxy.state.lora.counts.loads == 2  # one load for four concurrent requests
        for _ in range(3):
            assert (await _complete(session, proxy.url, "sql"))[0] == 200
        assert proxy.state.lora.counts.loads == 2 and _holding(sims, "sql") == holders
        used = [i for i, s in enumerate(sims) if s.generation_requests()]
        assert used == holders


async def test_max_loras_evicts_the_adapter_requested_longest_ago() -> None:
    async with fleet(max_loras=1) as (proxy, sims), aiohttp.ClientSession() as session:
        assert (await _complete(session, proxy.url, "sql"))[0] == 200
        had_sql = set(_holding(sims, "sql"))
        for _ in range(2):  # the second kw request finds it loaded
            assert (await _complete(session, proxy.url, "kw"))[0] == 200
        counts = proxy.state.lora.counts
        assert counts.loads == 4
        assert all(len(s._server.app.served.adapters) <= 1 for s in sims)
        evicted = had_sql & set(_holding(sims, "kw"))  # sql made room for kw there
        assert counts.evictions == len(evicted) and not evicted & set(_holding(sims, "sql"))


async def test_an_adapter_not_in_lora_modules_is_a_404_without_a_load() -> None:
    async with fleet() as (proxy, sims), aiohttp.ClientSession() as session:
        status, answer = await _complete(session, proxy.url, "nope")
        assert status == 404 and answer["error"]["param"] == "model"
        assert proxy.state.lora.counts.loads == 0
        assert not any(s.generation_requests() for s in sims)


async def test_a_hot_adapter_spreads_to_a_second_pair() -> None:
    async with fleet() as (proxy, sims), aiohttp.ClientSession() as session:
        assert (await _complete(session, proxy.url, "sql"))[0] == 200
        first = _holding(sims, "sql")
        holder = proxy.state.registry.get(sims[first[1]].url)
        holder.legs.work = 10.0  # its decode is far busier than the other one
        try:
            assert (await _complete(session, proxy.url, "sql"))[0] == 200
        finally:
            holder.legs.work = 0.0
        assert _holding(sims, "sql") == [0, 1, 2, 3]  # both pairs hold it now
        assert proxy.state.lora.counts.loads == 4
        assert (await _complete(session, proxy.url, "sql"))[0] == 200  # no third load
        assert proxy.state.lora.counts.loads == 4


async def test_the_load_carries_the_engine_api_key() -> None:
    """vLLM started with --api-key guards /v1/load_lora_adapter as it guards the legs."""
    async with fleet(engine_api_key="k-123") as (proxy, sims), aiohttp.ClientSession() as s:
        assert (await _complete(s, proxy.url, "sql"))[0] == 200
        loads = [r for sim in sims for r in sim.requests if r.path == "/v1/load_lora_adapter"]
        assert len(loads) == 2
        assert all(r.headers.get("authorization") == "Bearer k-123" for r in loads)
