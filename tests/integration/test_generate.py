"""The token-in path (``/inference/v1/generate``) through pdproxy in front of sims, and usage
that tells the truth on every path: the prefill's prefix-cache hit is what the client's
``usage.prompt_tokens_details.cached_tokens`` shows (text and token-in, whole and
streamed, decode-only, a retried decode)."""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
import pytest

from engines.sim import model
from pdproxy.config.scheduling import SchedulingConfig
from tests.integration.conftest import MODEL, deployment

GENERATE = "/inference/v1/generate"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
LONG = " ".join(f"word{i}" for i in range(80))  # 80 tokens: five sim blocks of 16


def _generate(prompt: str, *, stream: bool, tokens: int = 6, **sampling: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "token_ids": model.tokenize(prompt),
        "sampling_params": {"max_tokens": tokens, "temperature": 0, **sampling},
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _text(path: str, prompt: str, *, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "temperature": 0, "stream": stream}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _body(path: str, prompt: str, *, stream: bool) -> dict[str, Any]:
    return (
        _generate(prompt, stream=stream) if path == GENERATE else _text(path, prompt, stream=stream)
    )


async def _post(url: str, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
        return r.status, await r.read()


def _events(raw: bytes) -> list[dict[str, Any]]:
    lines = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert lines[-1] == b"[DONE]"
    return [orjson.loads(line) for line in lines[:-1]]


def _usage(raw: bytes, *, stream: bool) -> dict[str, Any]:
    if not stream:
        usage: dict[str, Any] = orjson.loads(raw)["usage"]
        return usage
    finals = [e["usage"] for e in _events(raw) if e.get("usage")]
    assert len(finals) == 1
    return finals[0]


def _token_ids(raw: bytes, *, stream: bool) -> list[int]:
    if not stream:
        return [t for c in orjson.loads(raw)["choices"] for t in c["token_ids"]]
    return [t for e in _events(raw) for c in e["choices"] for t in c["token_ids"]]


def _cached(raw: bytes, *, stream: bool) -> int:
    cached: int = _usage(raw, stream=stream)["prompt_tokens_details"]["cached_tokens"]
    return cached


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_generate_runs_both_legs_and_answers_as_a_single_engine(stream):
    async with deployment(n_prefill=1, n_decode=1) as d:
        body = _generate("the token in path", stream=stream)
        status, raw = await _post(d.proxy.url, GENERATE, body)
        assert status == 200, raw
        _, reference = await _post(d.single.url, GENERATE, body)
        assert _token_ids(raw, stream=stream) == _token_ids(reference, stream=stream)
        assert len(_token_ids(raw, stream=stream)) == 6
        (p_leg,) = d.prefills[0].generation_requests()
        (d_leg,) = d.decodes[0].generation_requests()
        assert p_leg.path == d_leg.path == GENERATE
        # P: one token, in sampling_params; not streamed; the connector's params.
        assert p_leg.body["sampling_params"] == {"max_tokens": 1, "temperature": 0}
        assert p_leg.body["stream"] is False and "stream_options" not in p_leg.body
        assert p_leg.body["kv_transfer_params"]["do_remote_decode"] is True
        # D: the client's request with P's params, as P returned them.
        assert d_leg.body["sampling_params"] == body["sampling_params"]
        assert d_leg.body["stream"] is stream
        assert d_leg.body["kv_transfer_params"]["do_remote_prefill"] is True
        assert d.decodes[0].counters.kv_transfers == 1


async def test_generate_keeps_min_tokens_off_the_prefill():
    async with deployment(n_prefill=1, n_decode=1) as d:
        body = _generate("min tokens stay on the decode", stream=False, min_tokens=3)
        status, raw = await _post(d.proxy.url, GENERATE, body)
        assert status == 200, raw
        (p_leg,) = d.prefills[0].generation_requests()
        assert p_leg.body["sampling_params"]["min_tokens"] == 1  # as many as it makes
        (d_leg,) = d.decodes[0].generation_requests()
        assert d_leg.body["sampling_params"]["min_tokens"] == 3


@pytest.mark.parametrize(
    "body",
    [
        {"model": MODEL, "sampling_params": {}},
        {"model": MODEL, "token_ids": [], "sampling_params": {}},
        {"model": MODEL, "token_ids": [1, 2]},
        {"model": MODEL, "token_ids": [1, 2], "sampling_params": [1]},
    ],
    ids=["no-token-ids", "empty-token-ids", "no-sampling-params", "sampling-params-not-object"],
)
async def test_generate_refuses_a_body_it_cannot_clamp(body):
    async with deployment(n_prefill=1, n_decode=1) as d:
        status, raw = await _post(d.proxy.url, GENERATE, body)
        assert status == 400, raw
        assert not d.prefills[0].generation_requests()


async def test_a_text_endpoint_refuses_a_token_in_body():
    async with deployment(n_prefill=1, n_decode=1) as d:
        body = {**_text(COMPLETIONS, "p", stream=False), **_generate("p", stream=False)}
        status, raw = await _post(d.proxy.url, COMPLETIONS, body)
        assert status == 400, raw
        assert orjson.loads(raw)["error"]["param"] == "sampling_params"
        assert not d.prefills[0].generation_requests()


async def test_render_then_generate_returns_the_single_engines_tokens():
    async with deployment(n_prefill=1, n_decode=1) as d:
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "render me"}]}
        status, raw = await _post(d.proxy.url, "/v1/chat/completions/render", chat)
        assert status == 200, raw
        rendered = orjson.loads(raw)
        # as vLLM: the limit the serving layer computed (the room left, none asked) ...
        room = 4096 - len(rendered["token_ids"])
        assert rendered["sampling_params"]["max_tokens"] == room
        status, raw = await _post(
            d.proxy.url, "/v1/chat/completions/render", {**chat, "max_tokens": 16}
        )
        # ... left out where it is 16, SamplingParams' default: the caller puts it back
        assert "max_tokens" not in orjson.loads(raw)["sampling_params"]
        rendered["sampling_params"]["max_tokens"] = 5
        status, raw = await _post(d.proxy.url, GENERATE, rendered)
        assert status == 200, raw
        _, reference = await _post(d.single.url, GENERATE, rendered)
        assert _token_ids(raw, stream=False) == _token_ids(reference, stream=False)
        # The render went to one decode, not through PD.
        assert [r.path for r in d.prefills[0].generation_requests()] == [GENERATE]


async def test_completions_render_answers_one_request_per_prompt():
    async with deployment(n_prefill=1, n_decode=1) as d:
        body = {"model": MODEL, "prompt": ["one prompt", "another prompt"]}
        status, raw = await _post(d.proxy.url, "/v1/completions/render", body)
        assert status == 200, raw
        rendered = orjson.loads(raw)
        assert [r["token_ids"] for r in rendered] == [
            model.tokenize("one prompt"),
            model.tokenize("another prompt"),
        ]
        assert not d.prefills[0].generation_requests()
        assert [r.path for r in d.decodes[0].generation_requests()] == ["/v1/completions/render"]


# Usage that tells the truth


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, GENERATE])
async def test_usage_shows_the_prefills_prefix_cache_hit(path, stream):
    async with deployment(n_prefill=1, n_decode=1) as d:
        prefill = d.prefills[0]
        status, first = await _post(d.proxy.url, path, _body(path, LONG, stream=stream))
        assert status == 200, first
        assert _cached(first, stream=stream) == 0  # no hit: cold cache
        assert prefill.counters.prefix_cache_hits == 0
        status, second = await _post(d.proxy.url, path, _body(path, LONG, stream=stream))
        assert status == 200, second
        hit = prefill.counters.prefix_cache_hits
        assert hit >= 64  # P found the prompt's full blocks in its cache
        # The decode loaded every token over the connector, yet reports P's hit.
        assert _cached(second, stream=stream) == hit
        assert _usage(second, stream=stream)["prompt_tokens"] > hit


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", [COMPLETIONS, GENERATE])
async def test_usage_on_a_decode_alone_is_the_decodes_own_hit(path, stream):
    scheduling = SchedulingConfig(
        prefill_policy="round-robin", decode_policy="round-robin", pd_threshold_tokens=1000
    )
    async with deployment(n_prefill=1, n_decode=1, proxy={"scheduling": scheduling}) as d:
        _, first = await _post(d.proxy.url, path, _body(path, LONG, stream=stream))
        _, second = await _post(d.proxy.url, path, _body(path, LONG, stream=stream))
        assert not d.prefills[0].generation_requests()  # short prompts: decode only
        assert _cached(first, stream=stream) == 0
        assert _cached(second, stream=stream) == d.decodes[0].counters.prefix_cache_hits >= 64


@pytest.mark.parametrize("path", [COMPLETIONS, GENERATE])
async def test_usage_survives_a_retried_decode(path):
    async with deployment(n_prefill=1, n_decode=2) as d:  # round-robin decodes (conftest)
        warm = _body(path, LONG, stream=False)
        status, _ = await _post(d.proxy.url, path, warm)  # P caches the prompt (via D0)
        assert status == 200
        await d.decodes[1].kill()  # round-robin picks D1 next: refused, retried on D0
        status, raw = await _post(d.proxy.url, path, _body(path, LONG, stream=False))
        assert status == 200, raw
        hit = d.prefills[0].counters.prefix_cache_hits
        assert hit >= 64
        assert _cached(raw, stream=False) == hit
        assert len(d.prefills[0].generation_requests()) == 2  # the prefill's answer reused
        assert len(d.decodes[0].generation_requests()) == 2
        registry = d.proxy.state.metrics.registry
        labels = {"leg": "decode", "reason": "connect"}
        assert registry.get_sample_value("pdproxy_retries_total", labels) == 1
