"""The token-in path and truthful usage through pdproxy in front of a real vLLM CPU NIXL
pair started with ``--enable-scale-out`` (the render and ``/inference/v1/generate``
endpoints) and ``--enable-prompt-tokens-details`` (``usage.prompt_tokens_details``).

* render → generate through pdproxy returns the tokens generate returns on one engine;
* a prefix-cache hit on the prefill shows in the client's ``cached_tokens`` (vLLM carries
  it to the decode as ``remote_prefill_cached_tokens`` in P's ``kv_transfer_params``,
  which pdproxy forwards untouched); without a hit it is 0; text and token-in paths,
  whole and streamed; and on a decode alone, the decode's own hit.

Each test salts its prompts (``cache_salt``), so no test's cached blocks serve another's.
"""

from __future__ import annotations

import uuid
from typing import Any

import orjson
import pytest

from engines.vllm.launch import EnginePair
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.types import EngineAddress
from tests.e2e.conftest import external_tokens, post
from tests.servers import running_proxy

pytestmark = pytest.mark.real_engine

GENERATE = "/inference/v1/generate"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
TEXT = (
    "def schedule(requests, budget):\n    # pick the requests that fit in the token budget\n"
    "    chosen = []\n    for request in sorted(requests, key=len):\n"
)
PROMPT = TEXT * 3  # about 200 tokens with the tiny model: six full blocks of 32
BLOCK = 32  # engines/vllm's --block-size


@pytest.fixture
def pair(tiny_nixl: EnginePair) -> EnginePair:
    """The session's tiny NIXL pair, started with SHARED_FLAGS (tests/e2e/conftest.py)."""
    return tiny_nixl


def _config(pair: EnginePair, scheduling: SchedulingConfig | None = None) -> ProxyConfig:
    extra: dict[str, Any] = {} if scheduling is None else {"scheduling": scheduling}
    return ProxyConfig(
        prefill=(EngineAddress(url=pair.prefill_url),),
        decode=(EngineAddress(url=pair.decode_url),),
        kv_connector=pair.connector,
        **extra,
    )


def _events(raw: bytes) -> list[dict[str, Any]]:
    lines = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
    assert lines and lines[-1] == b"[DONE]", raw[-300:]
    return [orjson.loads(line) for line in lines[:-1]]


def _token_ids(raw: bytes, *, stream: bool) -> list[int]:
    if not stream:
        return [t for c in orjson.loads(raw)["choices"] for t in c["token_ids"]]
    return [t for e in _events(raw) for c in e.get("choices", []) for t in c["token_ids"] or []]


def _usage(raw: bytes, *, stream: bool) -> dict[str, Any]:
    if not stream:
        usage: dict[str, Any] = orjson.loads(raw)["usage"]
        return usage
    finals = [e["usage"] for e in _events(raw) if e.get("usage")]
    assert len(finals) == 1, raw[-500:]
    return finals[0]


async def _rendered(url: str, pair: EnginePair, text: str, max_tokens: int) -> dict[str, Any]:
    """``text`` rendered (through pdproxy's pass-through) as a generate body; the render
    leaves ``max_tokens`` out, so the caller's limit is put in."""
    status, raw = await post(url, "/v1/completions/render", {"model": pair.model, "prompt": text})
    assert status == 200, raw
    (request,) = orjson.loads(raw)
    params = {**request["sampling_params"], "max_tokens": max_tokens, "temperature": 0}
    return {"model": pair.model, "token_ids": request["token_ids"], "sampling_params": params}


def _text_body(pair: EnginePair, path: str, text: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": pair.model, "max_tokens": max_tokens, "temperature": 0}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


async def _body(url: str, pair: EnginePair, path: str, text: str, stream: bool) -> dict[str, Any]:
    if path == GENERATE:
        body = await _rendered(url, pair, text, 4)
    else:
        body = _text_body(pair, path, text, 4)
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_render_then_generate_equals_generate_on_one_engine(pair, stream):
    async with running_proxy(_config(pair)) as proxy:
        body = await _rendered(proxy.url, pair, f"# generate {stream}\n" + PROMPT, 12)
        moved_before = external_tokens(pair)
        status, raw = await post(proxy.url, GENERATE, {**body, "stream": stream})
    assert status == 200, raw
    assert external_tokens(pair) - moved_before >= BLOCK  # the decode read P's KV
    reference_body = {**body, "cache_salt": uuid.uuid4().hex}  # the decode alone, cold
    ref_status, reference = await post(pair.decode_url, GENERATE, reference_body)
    assert ref_status == 200, reference
    got = _token_ids(raw, stream=stream)
    assert got == _token_ids(reference, stream=False)
    assert len(got) == 12


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, GENERATE])
async def test_cached_tokens_are_the_prefills_hit(pair, path, stream):
    salt = uuid.uuid4().hex  # a cache of its own: nothing is cached before the first
    async with running_proxy(_config(pair)) as proxy:
        body = {**await _body(proxy.url, pair, path, PROMPT, stream), "cache_salt": salt}
        status, first = await post(proxy.url, path, body)
        assert status == 200, first
        hits_before = pair.prefill.metric("vllm:prefix_cache_hits_total")
        status, second = await post(proxy.url, path, body)
        assert status == 200, second
    prefill_hit = pair.prefill.metric("vllm:prefix_cache_hits_total") - hits_before
    assert _usage(first, stream=stream)["prompt_tokens_details"]["cached_tokens"] == 0
    usage = _usage(second, stream=stream)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == prefill_hit, (usage, prefill_hit)
    assert cached >= 3 * BLOCK and cached % BLOCK == 0
    assert cached < usage["prompt_tokens"]  # P's hit, not the decode's ~100 % from the transfer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_cached_tokens_on_a_decode_alone_are_its_own_hit(pair, stream):
    scheduling = SchedulingConfig(pd_threshold_tokens=100_000)  # every prompt is short
    salt = uuid.uuid4().hex
    async with running_proxy(_config(pair, scheduling)) as proxy:
        body = {**await _body(proxy.url, pair, GENERATE, PROMPT, stream), "cache_salt": salt}
        prefill_before = pair.prefill.metric("vllm:prompt_tokens_total")
        _, first = await post(proxy.url, GENERATE, body)
        hits_before = pair.decode.metric("vllm:prefix_cache_hits_total")
        _, second = await post(proxy.url, GENERATE, body)
    assert pair.prefill.metric("vllm:prompt_tokens_total") == prefill_before  # no prefill leg
    decode_hit = pair.decode.metric("vllm:prefix_cache_hits_total") - hits_before
    assert _usage(first, stream=stream)["prompt_tokens_details"]["cached_tokens"] == 0
    cached = _usage(second, stream=stream)["prompt_tokens_details"]["cached_tokens"]
    assert cached == decode_hit >= 3 * BLOCK
