"""A LoRA adapter through real vLLM CPU engines (SmolLM2-135M-Instruct, NIXL, the session's
pair started with --enable-lora): an adapter with random weights, made at test time, is
loaded on the prefill and the decode through pdproxy's /v1/load_lora_adapter; a greedy
request naming it through the PD pair answers what one engine alone answers with the same
adapter, and not what the base model answers, with the prompt's KV moved over NIXL.
"""

from __future__ import annotations

import dataclasses

import orjson
import pytest

from engines.vllm.launch import SMOLLM2
from engines.vllm.make_lora import write_random_lora
from engines.vllm.settings import Settings
from tests.e2e.conftest import external_tokens, output_text, post
from tests.e2e.test_real_nixl import isolated, proxy_config
from tests.servers import running_proxy

pytestmark = pytest.mark.real_engine

ADAPTER = "smollm2-random-lora"
ADMIN = "lora-admin-key"  # pdproxy's LoRA API is admin work; vLLM's Bearer spelling works
BEARER = {"Authorization": f"Bearer {ADMIN}"}
PROMPT = "The three most important things to pack for a long hike are"


def _completion(model: str) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}


async def test_adapter_through_pd_equals_one_engine_and_differs_from_base(
    smollm2_nixl, tmp_path, record_property
):
    pair = smollm2_nixl
    model_dir = pair.model_dir or Settings.from_env(model=SMOLLM2).model_dir
    adapter = write_random_lora(model_dir, tmp_path / "lora", seed=23)
    load = {"lora_name": ADAPTER, "lora_path": str(adapter)}
    config = dataclasses.replace(proxy_config(pair), admin_api_key=ADMIN)
    async with running_proxy(config) as proxy:
        status, raw = await post(proxy.url, "/v1/load_lora_adapter", load, headers=BEARER)
        assert status == 200, raw
        try:
            pools = proxy.state.registry.pools()
            assert [e.url for e in pools.lookup(ADAPTER).decode] == [pair.decode_url]
            assert [e.url for e in pools.lookup(ADAPTER).prefill] == [pair.prefill_url]
            before = external_tokens(pair)
            status, raw = await post(proxy.url, "/v1/completions", isolated(_completion(ADAPTER)))
            assert status == 200, raw
            moved = external_tokens(pair) - before
        finally:  # the session's pair goes back to its base weights alone
            await post(proxy.url, "/v1/unload_lora_adapter", {"lora_name": ADAPTER}, headers=BEARER)
    through_pd = output_text(raw, chat=False, stream=False)
    record_property("adapter_answer", through_pd)
    # one engine alone, the same adapter (loaded on it again: the proxy unloaded it)
    assert (await post(pair.decode_url, "/v1/load_lora_adapter", load))[0] == 200
    try:
        _, alone = await post(pair.decode_url, "/v1/completions", isolated(_completion(ADAPTER)))
    finally:
        await post(pair.decode_url, "/v1/unload_lora_adapter", {"lora_name": ADAPTER})
    _, base = await post(pair.decode_url, "/v1/completions", isolated(_completion(pair.model)))
    print(
        f"adapter through PD: {through_pd!r}; base: {output_text(base, chat=False, stream=False)!r}"
    )
    assert through_pd == output_text(alone, chat=False, stream=False)
    assert through_pd != output_text(base, chat=False, stream=False)
    prompt_tokens = orjson.loads(alone)["usage"]["prompt_tokens"]
    assert prompt_tokens - 1 <= moved <= prompt_tokens, (moved, prompt_tokens)
