"""Tokenize once (``--render-once``) through pdproxy in front of sims: a text request is
rendered once, both legs run on its token ids over ``/inference/v1/generate``, and the
client gets the text path's answer byte for byte apart from ``created`` (completions and
chat, whole and streamed); requests that need vLLM's OpenAI post-processing take the text
path; usage tells the prefill's cache hit."""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from engines.sim import SimConfig, running_sim
from pdproxy.config.proxy import ProxyConfig
from pdproxy.types import EngineAddress
from tests.integration.conftest import MODEL, ROUND_ROBIN, deployment
from tests.servers import running_proxy

GENERATE = "/inference/v1/generate"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
RENDER = {COMPLETIONS: "/v1/completions/render", CHAT: "/v1/chat/completions/render"}
LONG = " ".join(f"word{i}" for i in range(80))  # 80 tokens: five sim blocks of 16
_CREATED = re.compile(rb'"created":\d+')


def _body(path: str, text: str, *, stream: bool, usage: bool = True, **extra: Any) -> dict:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 7, "temperature": 0, "stream": stream}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if stream and usage:
        body["stream_options"] = {"include_usage": True}
    return {**body, **extra}


async def _post(url: str, path: str, body: dict[str, Any], request_id: str = "ro-1"):
    headers = {"X-Request-Id": request_id}
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body, headers=headers) as r:
        return r.status, await r.read()


def _generate_legs(sim: Any) -> list[Any]:
    return [r for r in sim.requests if r.path == GENERATE]


def _metric(proxy: Any, name: str, **labels: str) -> float:
    value = proxy.state.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else float(value)


def _sans_created(raw: bytes) -> bytes:
    return _CREATED.sub(b'"created":0', raw)


def _events(raw: bytes) -> list[dict[str, Any]]:
    lines = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]", raw[-200:]
    return [orjson.loads(line) for line in lines[:-1]]


def _usage(raw: bytes, *, stream: bool) -> dict[str, Any]:
    if not stream:
        usage: dict[str, Any] = orjson.loads(raw)["usage"]
        return usage
    (usage,) = [e["usage"] for e in _events(raw) if e.get("usage")]
    return usage


@contextlib.asynccontextmanager
async def _render_once(**proxy: Any) -> AsyncIterator[Any]:
    async with deployment(n_prefill=1, n_decode=1, proxy={"render_once": True, **proxy}) as d:
        yield d


@pytest.mark.parametrize("usage", [True, False], ids=["usage", "no-usage"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_render_once_answers_the_text_paths_bytes(path, stream, usage):
    if not stream and not usage:
        pytest.skip("a whole answer always has its usage")
    body = _body(path, "tokenize me once " + LONG, stream=stream, usage=usage)
    async with deployment(n_prefill=1, n_decode=1) as text:  # fresh caches each
        status, expected = await _post(text.proxy.url, path, body)
    assert status == 200, expected
    async with _render_once() as d:
        status, got = await _post(d.proxy.url, path, body)
        assert status == 200, got
        served = [
            r.path
            for r in d.decodes[0].requests
            if r.path not in ("/health", "/metrics", "/v1/models")
        ]
        (p_leg,) = d.prefills[0].generation_requests()
        (d_leg,) = _generate_legs(d.decodes[0])
    assert _sans_created(got) == _sans_created(expected)
    # rendered once, on the decode (no --render servers); its fingerprint asked before the
    # legs, so the probe never shares a batch with the request
    assert served == [RENDER[path], COMPLETIONS, GENERATE]
    assert p_leg.path == d_leg.path == GENERATE
    assert p_leg.body["token_ids"] == d_leg.body["token_ids"]
    assert p_leg.body["sampling_params"]["max_tokens"] == 1
    assert d_leg.body["sampling_params"]["max_tokens"] == 7  # the client's limit
    assert d_leg.body["output_mode"] == "text"
    assert d_leg.body["kv_transfer_params"]["do_remote_prefill"] is True


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_a_limit_of_sixteen_is_carried_over(path):
    """vLLM's render leaves max_tokens out where it is 16 (SamplingParams' default): pdproxy
    puts it back, or generate would fill the rest of the context."""
    body = _body(path, "sixteen tokens please", stream=False, max_tokens=16)
    async with _render_once() as d:
        status, raw = await _post(d.proxy.url, path, body)
        (d_leg,) = _generate_legs(d.decodes[0])
    assert status == 200, raw
    assert d_leg.body["sampling_params"]["max_tokens"] == 16
    assert orjson.loads(raw)["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize(
    ("path", "extra", "reason"),
    [
        (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        (COMPLETIONS, {"n": 2}, "parallel_sampling"),
        (COMPLETIONS, {"logprobs": 0}, "logprobs"),
        (CHAT, {"logprobs": True, "top_logprobs": 2}, "logprobs"),
        (COMPLETIONS, {"echo": True}, "echo"),
        (CHAT, {"response_format": {"type": "json_object"}}, "structured_output"),
        (CHAT, {"add_generation_prompt": False}, "chat_role"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
async def test_requests_that_need_the_openai_layer_take_the_text_path(path, extra, reason):
    body = _body(path, "the text path", stream=False, **extra)
    async with _render_once() as d:
        status, raw = await _post(d.proxy.url, path, body)
        legs = {r.path for r in d.engines[0].requests + d.decodes[0].requests}
        served = _metric(d.proxy, "pdproxy_render_once_requests_total", served=reason)
    assert status == 200, raw
    assert GENERATE not in legs and RENDER[path] not in legs
    assert served == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_cached_tokens_are_the_prefills_hit(path, stream):
    body = _body(path, LONG, stream=stream)
    async with _render_once() as d:
        _, first = await _post(d.proxy.url, path, body)
        _, second = await _post(d.proxy.url, path, body)
    assert _usage(first, stream=stream)["prompt_tokens_details"]["cached_tokens"] == 0
    usage = _usage(second, stream=stream)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 64 and cached % 16 == 0  # P's hit in whole blocks
    assert cached < usage["prompt_tokens"]  # not the decode's ~100 % from the transfer


async def test_a_render_error_reaches_the_client_as_the_engine_said():
    body = {**_body(CHAT, "wrong model", stream=False), "model": "no-such-model"}
    async with _render_once() as d:
        status, raw = await _post(d.proxy.url, CHAT, body)
        assert not d.prefills[0].generation_requests()
    assert status == 404, raw
    assert "no-such-model" in orjson.loads(raw)["error"]["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_render_servers_render_and_the_decodes_only_generate(stream):
    async with contextlib.AsyncExitStack() as stack:
        d = await stack.enter_async_context(deployment(n_prefill=1, n_decode=1))
        renderers = [
            await stack.enter_async_context(running_sim(SimConfig(role="both", model=MODEL)))
            for _ in range(2)
        ]
        config = ProxyConfig(
            prefill=(EngineAddress(url=d.prefills[0].url),),
            decode=(EngineAddress(url=d.decodes[0].url),),
            render_once=True,
            render=tuple(EngineAddress(url=r.url) for r in renderers),
            scheduling=ROUND_ROBIN,
        )
        proxy = await stack.enter_async_context(running_proxy(config))
        for i in range(2):
            status, raw = await _post(proxy.url, CHAT, _body(CHAT, f"chat {i}", stream=stream))
            assert status == 200, raw
        assert [len(r.requests) for r in renderers] == [1, 1]  # spread over the pool
        served = {r.path for r in d.decodes[0].requests} - {"/health", "/metrics", "/v1/models"}
        assert served == {GENERATE, COMPLETIONS}
        # the one completion: the decode's system_fingerprint, asked once
        assert len([r for r in d.decodes[0].requests if r.path == COMPLETIONS]) == 1
