"""The sim's models: several bases, LoRA adapters loaded and unloaded at run time with
vLLM's endpoints, bodies and errors, and KV refused when another model produced it."""

from __future__ import annotations

import orjson

from engines.sim import SimConfig, running_sim
from tests.sim.helpers import COMPLETIONS, body_for, post, prefill, text_of

LOAD = "/v1/load_lora_adapter"
UNLOAD = "/v1/unload_lora_adapter"


async def _models(session, url: str) -> dict[str, str | None]:
    async with session.get(url + "/v1/models") as resp:
        data = orjson.loads(await resp.read())["data"]
    return {card["id"]: card["parent"] for card in data}


async def test_models_lists_bases_and_adapters_with_parent(session):
    config = SimConfig(model="base", served_models=("other",), lora_modules=("sql=/a/sql",))
    async with running_sim(config) as sim:
        assert await _models(session, sim.url) == {"base": None, "other": None, "sql": "base"}


async def test_load_and_unload_as_vllm(session):
    async with running_sim(SimConfig(model="base")) as sim:
        body = {"lora_name": "sql", "lora_path": "/a/sql"}
        async with session.post(sim.url + LOAD, json=body) as resp:
            assert resp.status == 200
            assert await resp.text() == "Success: LoRA adapter 'sql' added successfully."
        assert await _models(session, sim.url) == {"base": None, "sql": "base"}
        status, raw = await post(session, sim.url + LOAD, body)
        assert status == 400 and orjson.loads(raw)["error"]["type"] == "InvalidUserInput"
        assert "has already been loaded" in orjson.loads(raw)["error"]["message"]
        status, raw = await post(session, sim.url + LOAD, {"lora_name": "x"})
        assert status == 400
        assert orjson.loads(raw)["error"]["message"] == (
            "Both 'lora_name' and 'lora_path' must be provided."
        )
        status, _ = await post(
            session, sim.url + COMPLETIONS, {**body_for(COMPLETIONS), "model": "sql"}
        )
        assert status == 200
        async with session.post(sim.url + UNLOAD, json={"lora_name": "sql"}) as resp:
            assert resp.status == 200
            assert await resp.text() == "Success: LoRA adapter 'sql' removed successfully."
        status, raw = await post(session, sim.url + UNLOAD, {"lora_name": "sql"})
        assert status == 404
        assert orjson.loads(raw)["error"] == {
            "message": "The lora adapter 'sql' cannot be found.",
            "type": "NotFoundError",
            "param": None,
            "code": 404,
        }


async def test_unknown_model_is_vllms_404(session):
    async with running_sim(SimConfig(model="base")) as sim:
        status, raw = await post(
            session, sim.url + COMPLETIONS, {**body_for(COMPLETIONS), "model": "nope"}
        )
    assert status == 404
    assert orjson.loads(raw)["error"] == {
        "message": "The model `nope` does not exist.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }


async def test_each_model_answers_its_own_words(session):
    config = SimConfig(model="base", lora_modules=("sql=/a/sql",))
    async with running_sim(config) as sim:
        texts = []
        for name in ("base", "sql"):
            _, raw = await post(
                session, sim.url + COMPLETIONS, {**body_for(COMPLETIONS, 8), "model": name}
            )
            texts.append(text_of(raw, False))
    assert texts[0] != texts[1]


async def test_decode_refuses_kv_of_another_model(session):
    common = {"model": "base", "lora_modules": ("sql=/a/sql",)}
    async with (
        running_sim(SimConfig(role="prefill", **common)) as p,
        running_sim(SimConfig(role="decode", **common)) as d,
    ):
        base = {**body_for(COMPLETIONS, 8), "model": "base"}
        params = await prefill(session, p.url, COMPLETIONS, base)
        status, raw = await post(
            session, d.url + COMPLETIONS, {**base, "model": "sql", "kv_transfer_params": params}
        )
        assert status == 500 and b"not produced by model 'sql'" in raw
        params = await prefill(session, p.url, COMPLETIONS, base)
        status, _ = await post(session, d.url + COMPLETIONS, {**base, "kv_transfer_params": params})
        assert status == 200
