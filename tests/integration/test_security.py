"""Client API keys (vLLM-compatible), the engine key, and what stays open."""

from __future__ import annotations

import aiohttp
import openai
import orjson
import pytest

from tests.integration.conftest import MODEL, deployment

CLIENT_KEY = "sk-client-3f9a0c"
OTHER_KEY = "sk-client-second"
ENGINE_KEY = "sk-engine-77b1e2"
BODY = {"model": MODEL, "prompt": "who may use this proxy", "max_tokens": 4}


async def _post(url, headers=None, body=BODY, path="/v1/completions"):
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body, headers=headers) as r:
        return r.status, await r.read()


async def _get(url, path, headers=None):
    async with aiohttp.ClientSession() as s, s.get(url + path, headers=headers) as r:
        return r.status, await r.read()


@pytest.mark.parametrize(
    "headers",
    [
        None,
        {"Authorization": "Bearer sk-wrong"},
        {"Authorization": CLIENT_KEY},  # no scheme
        {"Authorization": f"Basic {CLIENT_KEY}"},
        {"Authorization": f"Bearer {CLIENT_KEY}x"},
    ],
)
async def test_missing_or_wrong_key_is_401_and_reaches_no_engine(headers):
    async with deployment(1, 1, proxy={"api_keys": (CLIENT_KEY,)}) as d:
        status, raw = await _post(d.proxy.url, headers)
        assert status == 401
        error = orjson.loads(raw)["error"]
        assert error["type"] == "AuthenticationError" and error["code"] == 401
        assert CLIENT_KEY not in raw.decode()
        assert d.generation_requests(d.engines) == []
        status, _ = await _get(d.proxy.url, "/v1/models", headers)
        assert status == 401


@pytest.mark.parametrize("key", [CLIENT_KEY, OTHER_KEY])
async def test_any_configured_key_passes_and_open_endpoints_stay_open(key):
    async with deployment(1, 1, proxy={"api_keys": (CLIENT_KEY, OTHER_KEY)}) as d:
        status, _ = await _post(d.proxy.url, {"Authorization": f"Bearer {key}"})
        assert status == 200
        for path in ("/health", "/ready", "/metrics"):
            assert (await _get(d.proxy.url, path))[0] == 200


async def test_openai_sdk_with_and_without_the_key():
    async with deployment(1, 1, proxy={"api_keys": (CLIENT_KEY,)}) as d:
        good = openai.AsyncOpenAI(base_url=d.proxy.url + "/v1", api_key=CLIENT_KEY, max_retries=0)
        bad = openai.AsyncOpenAI(base_url=d.proxy.url + "/v1", api_key="sk-nope", max_retries=0)
        async with good, bad:
            answer = await good.completions.create(model=MODEL, prompt="hi", max_tokens=3)
            assert answer.choices[0].text
            models = await good.models.list()
            assert [m.id for m in models.data] == [MODEL]
            with pytest.raises(openai.AuthenticationError):
                await bad.completions.create(model=MODEL, prompt="hi", max_tokens=3)


async def test_protected_metrics_need_the_key():
    proxy = {"api_keys": (CLIENT_KEY,), "protect_metrics": True}
    async with deployment(1, 1, proxy=proxy) as d:
        assert (await _get(d.proxy.url, "/metrics"))[0] == 401
        auth = {"Authorization": f"Bearer {CLIENT_KEY}"}
        assert (await _get(d.proxy.url, "/metrics", auth))[0] == 200
        assert (await _get(d.proxy.url, "/health"))[0] == 200


async def test_engine_key_replaces_the_clients_on_every_leg():
    proxy = {"api_keys": (CLIENT_KEY,), "engine_api_key": ENGINE_KEY}
    async with deployment(1, 1, proxy=proxy) as d:
        for stream in (False, True):
            status, _ = await _post(
                d.proxy.url, {"Authorization": f"Bearer {CLIENT_KEY}"}, {**BODY, "stream": stream}
            )
            assert status == 200
        legs = d.generation_requests(d.engines)
        assert len(legs) == 4
        assert {r.headers.get("authorization") for r in legs} == {f"Bearer {ENGINE_KEY}"}


async def test_without_an_engine_key_the_clients_header_passes_through():
    async with deployment(1, 1) as d:
        status, _ = await _post(d.proxy.url, {"Authorization": "Bearer sk-for-the-engines"})
        assert status == 200
        legs = d.generation_requests(d.engines)
        assert {r.headers.get("authorization") for r in legs} == {"Bearer sk-for-the-engines"}
