"""Routing by ``model``: 3 models over 2 prefills and 3 decodes (one prefill serving two),
LoRA adapters loaded and unloaded at run time, through a real pdproxy on sims that hold
their models as vLLM does (a decode refuses KV another model produced)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp
import orjson
import pytest

from engines.sim import SimConfig, SimHandle, running_sim
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.resilience import HealthConfig
from pdproxy.types import EngineAddress
from tests.integration.conftest import ROUND_ROBIN
from tests.servers import RunningProxy, running_proxy

ALPHA, BETA, GAMMA, SQL = "alpha", "beta", "gamma", "sql"
SERVES = {"p1": {ALPHA, BETA}, "p2": {GAMMA}, "d1": {ALPHA}, "d2": {BETA}, "d3": {GAMMA}}
PROMPT = "the quick brown fox jumps over the lazy dog"


@dataclass
class Fleet:
    proxy: RunningProxy
    sims: dict[str, SimHandle]
    single: SimHandle  # every model and the adapter on one engine: the reference answers

    def legs(self) -> dict[str, list[str]]:
        """Each sim's generation requests, by the model they named."""
        return {
            name: [str((r.body or {}).get("model")) for r in sim.generation_requests()]
            for name, sim in self.sims.items()
        }

    def clear(self) -> None:
        for sim in self.sims.values():
            sim.clear_requests()


def _sim(role: str, models: set[str]) -> SimConfig:
    first, *more = sorted(models)
    return SimConfig(role=role, model=first, served_models=tuple(more), strict=True)


@contextlib.asynccontextmanager
async def fleet(**health: float) -> AsyncIterator[Fleet]:
    async with contextlib.AsyncExitStack() as stack:
        sims = {
            name: await stack.enter_async_context(
                running_sim(_sim("prefill" if name[0] == "p" else "decode", models))
            )
            for name, models in SERVES.items()
        }
        single = await stack.enter_async_context(
            running_sim(
                SimConfig(model=ALPHA, served_models=(BETA, GAMMA), lora_modules=(f"{SQL}=/a",))
            )
        )
        config = ProxyConfig(
            prefill=tuple(EngineAddress(url=s.url) for n, s in sims.items() if n[0] == "p"),
            decode=tuple(EngineAddress(url=s.url) for n, s in sims.items() if n[0] == "d"),
            scheduling=ROUND_ROBIN,
            health=HealthConfig(models_interval=0.05, **health),
            admin_api_key=ADMIN,
        )
        proxy = await stack.enter_async_context(running_proxy(config))
        await _until(lambda: set(proxy.state.registry.pools().by_model) == {ALPHA, BETA, GAMMA})
        yield Fleet(proxy, sims, single)


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(400):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in 4 s")


async def _complete(url: str, model: str) -> tuple[int, dict]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        return r.status, orjson.loads(await r.read())


ADMIN = "lora-admin-key"  # LoRA administration through pdproxy is admin work


async def _post(url: str, path: str, body: dict) -> tuple[int, bytes]:
    headers = {"X-API-Key": ADMIN}
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body, headers=headers) as r:
        return r.status, await r.read()


async def test_every_request_reaches_a_pair_serving_its_model() -> None:
    async with fleet() as f:
        for model in (ALPHA, BETA, GAMMA) * 3:
            status, answer = await _complete(f.proxy.url, model)
            _, expected = await _complete(f.single.url, model)
            assert status == 200, answer
            assert answer["choices"][0]["text"] == expected["choices"][0]["text"]
        legs = f.legs()
        for name, models in legs.items():
            assert models and set(models) <= SERVES[name], (name, models)
        assert legs["p1"].count(ALPHA) == legs["p1"].count(BETA) == 3
        async with aiohttp.ClientSession() as s, s.get(f.proxy.url + "/metrics") as r:
            page = await r.text()
        d3 = f.sims["d3"].url
        assert f'pdproxy_endpoint_model{{model="{GAMMA}",role="decode",url="{d3}"}} 1.0' in page
        pools = await _status_models(f.proxy.url)
        assert pools[GAMMA] == {
            "prefill": [f.sims["p2"].url.split("//")[1]],
            "decode": [f.sims["d3"].url.split("//")[1]],
        }


async def _status_models(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(url + "/status") as r:
        return dict(orjson.loads(await r.read())["models"])


async def test_unknown_model_is_vllms_404_without_an_engine() -> None:
    async with fleet() as f:
        f.clear()
        status, answer = await _complete(f.proxy.url, "nope")
        assert status == 404
        assert answer["error"] == {
            "message": "The model `nope` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
        assert all(not legs for legs in f.legs().values())


async def test_an_adapter_on_one_pair_is_routed_there_and_unloading_moves_it() -> None:
    async with fleet() as f:
        load = {"lora_name": SQL, "lora_path": "/a"}
        for name in ("p2", "d3"):
            assert (await _post(f.sims[name].url, "/v1/load_lora_adapter", load))[0] == 200
        await f.proxy.state.models.read_all()
        _, expected = await _complete(f.single.url, SQL)
        for _ in range(3):
            status, answer = await _complete(f.proxy.url, SQL)
            assert status == 200 and answer["choices"][0]["text"] == expected["choices"][0]["text"]
        assert {n for n, legs in f.legs().items() if SQL in legs} == {"p2", "d3"}
        # held by p1/d1 too, then unloaded from p2/d3: its traffic moves
        for name in ("p1", "d1"):
            assert (await _post(f.sims[name].url, "/v1/load_lora_adapter", load))[0] == 200
        status, raw = await _post(f.proxy.url, "/v1/unload_lora_adapter", {"lora_name": SQL})
        assert status == 200 and b"removed successfully" in raw
        assert f.proxy.state.registry.pools().lookup(SQL).decode == ()
        status, answer = await _complete(f.proxy.url, SQL)
        assert status == 404 and answer["error"]["param"] == "model"


async def test_unloading_from_one_pair_moves_its_traffic_to_another() -> None:
    async with fleet() as f:
        load = {"lora_name": SQL, "lora_path": "/a"}
        for name in ("p1", "d1", "p2", "d3"):
            assert (await _post(f.sims[name].url, "/v1/load_lora_adapter", load))[0] == 200
        for name in ("p2", "d3"):
            assert (await _post(f.sims[name].url, "/v1/unload_lora_adapter", load))[0] == 200
        await f.proxy.state.models.read_all()
        f.clear()
        for _ in range(3):
            assert (await _complete(f.proxy.url, SQL))[0] == 200
        assert {n for n, legs in f.legs().items() if SQL in legs} == {"p1", "d1"}


async def test_load_through_pdproxy_reaches_every_instance_and_lists_parent() -> None:
    async with fleet() as f:
        load = {"lora_name": SQL, "lora_path": "/a"}
        status, raw = await _post(f.proxy.url, "/v1/load_lora_adapter", load)
        assert status == 200 and raw == b"Success: LoRA adapter 'sql' added successfully."
        assert set(f.proxy.state.registry.pools().by_model) == {ALPHA, BETA, GAMMA, SQL}
        async with aiohttp.ClientSession() as s, s.get(f.proxy.url + "/v1/models") as r:
            cards = {c["id"]: c for c in orjson.loads(await r.read())["data"]}
        assert set(cards) == {ALPHA, BETA, GAMMA, SQL} and cards[SQL]["parent"] is not None
        assert cards[ALPHA]["parent"] is None
        status, raw = await _post(f.proxy.url, "/v1/load_lora_adapter", load)
        assert status == 400 and b"already been loaded" in raw
        assert f.proxy.state.lora.counts.loads == len(SERVES)


@pytest.mark.parametrize("model", [GAMMA])
async def test_the_only_pair_of_a_model_down_is_503_naming_it(model: str) -> None:
    async with fleet(interval=0.05, failure_threshold=1) as f:
        f.sims["d3"].set_faults(health_status=503)
        d3 = f.proxy.state.registry.get(f.sims["d3"].url)
        await _until(lambda: not d3.routable)
        f.clear()
        status, answer = await _complete(f.proxy.url, model)
        assert status == 503 and f"'{model}'" in answer["error"]["message"]
        assert all(not legs for legs in f.legs().values())
        for other in (ALPHA, BETA):
            assert (await _complete(f.proxy.url, other))[0] == 200


async def test_admin_add_may_state_the_models_the_instance_must_serve() -> None:
    async with (
        running_sim(SimConfig(role="prefill", model=ALPHA)) as p,
        running_sim(SimConfig(role="decode", model=ALPHA)) as d,
        running_sim(SimConfig(role="decode", model=ALPHA, served_models=(BETA,))) as extra,
    ):
        config = ProxyConfig(
            prefill=(EngineAddress(url=p.url),),
            decode=(EngineAddress(url=d.url),),
            admin_api_key="k" * 16,
            health=HealthConfig(models_interval=0.05),
        )
        async with running_proxy(config) as proxy, aiohttp.ClientSession() as s:
            headers = {"X-API-Key": "k" * 16}
            add = {"type": "decode", "instance": extra.url.split("//")[1]}
            for stated, status in (([GAMMA], 400), (["x", 1], 400), ([ALPHA, BETA], 200)):
                body = {**add, "models": stated}
                async with s.post(proxy.url + "/instances/add", json=body, headers=headers) as r:
                    assert r.status == status, await r.text()
            await _until(lambda: set(proxy.state.registry.pools().by_model) == {ALPHA, BETA})
