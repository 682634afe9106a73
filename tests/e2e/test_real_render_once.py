"""Tokenize once (``--render-once``) through pdproxy in front of a real vLLM CPU NIXL pair
serving SmolLM2-135M-Instruct with ``--enable-scale-out`` and
``--enable-prompt-tokens-details``:

* the answer is the text path's, byte for byte apart from ``created``: completions and
  chat, whole and streamed (with and without the usage chunk), at temperature 0, both
  proxies in front of the same pair and each request with the same ``X-Request-Id``;
* the client's ``cached_tokens`` is the prefill's prefix-cache hit on this path too.

Every request is salted (``cache_salt``): the salt changes no output, only which cached
blocks it may use.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

import aiohttp
import orjson
import pytest

from engines.vllm.launch import EnginePair
from pdproxy.config.proxy import ProxyConfig
from pdproxy.types import EngineAddress
from tests.e2e.conftest import external_tokens
from tests.servers import running_proxy

pytestmark = pytest.mark.real_engine

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BLOCK = 32  # engines/vllm's --block-size
_CREATED = re.compile(rb'"created":\d+')
QUESTION = "What is the capital of France? Answer in two sentences."
STORY = (
    "A prefill engine computes the prompt's cache and hands it to a decode engine over the "
    "connector, which then writes the answer one token at a time. "
) * 4


@pytest.fixture
def pair(smollm2_nixl: EnginePair) -> EnginePair:
    """The session's SmolLM2 NIXL pair, started with SHARED_FLAGS (tests/e2e/conftest.py)."""
    return smollm2_nixl


def _config(pair: EnginePair, render_once: bool) -> ProxyConfig:
    return ProxyConfig(
        prefill=(EngineAddress(url=pair.prefill_url),),
        decode=(EngineAddress(url=pair.decode_url),),
        kv_connector=pair.connector,
        render_once=render_once,
    )


def _body(pair: EnginePair, path: str, *, stream: bool, usage: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {"model": pair.model, "max_tokens": 24, "temperature": 0}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": QUESTION}]
    else:
        body["prompt"] = "The capital of France is"
    body["stream"] = stream
    if stream and usage:
        body["stream_options"] = {"include_usage": True}
    return body


async def _post(url: str, path: str, body: dict[str, Any], request_id: str) -> bytes:
    headers = {"X-Request-Id": request_id}
    timeout = aiohttp.ClientTimeout(total=120)
    async with (
        aiohttp.ClientSession(timeout=timeout) as s,
        s.post(url + path, json=body, headers=headers) as r,
    ):
        raw = await r.read()
        assert r.status == 200, raw
        return raw


def _merged(raw: bytes) -> tuple[set[bytes], list[bytes]]:
    """A stream with its token chunks merged: the distinct token chunks with their text
    emptied, and the other chunks, the last token chunk carrying all the text."""
    shapes: set[bytes] = set()
    others: list[bytes] = []
    text: list[str] = []
    for line in raw.split(b"\n"):
        if not line.startswith(b"data: {"):
            continue
        event = orjson.loads(line[6:])
        choices = event.get("choices") or [{}]
        piece = choices[0].get("delta", choices[0])
        if ("content" not in piece and "text" not in piece) or piece.get("role"):
            others.append(line)
            continue
        key = "content" if "content" in piece else "text"
        text.append(piece[key])
        piece[key] = ""
        if choices[0].get("finish_reason") is None:
            shapes.add(orjson.dumps(event))
        else:
            piece[key] = "".join(text)
            others.append(orjson.dumps(event))
    return shapes, others


def _usage(raw: bytes, *, stream: bool) -> dict[str, Any]:
    if not stream:
        usage: dict[str, Any] = orjson.loads(raw)["usage"]
        return usage
    events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: {")]
    (usage,) = [e["usage"] for e in map(orjson.loads, events) if e.get("usage")]
    return usage


@pytest.mark.parametrize(
    ("stream", "usage"),
    [(False, True), (True, True), (True, False)],
    ids=["whole", "stream", "stream-no-usage"],
)
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_render_once_answers_the_text_paths_bytes(pair, path, stream, usage):
    body = _body(pair, path, stream=stream, usage=usage)
    request_id = uuid.uuid4().hex  # the same on both paths: the answers' ids are equal
    async with running_proxy(_config(pair, False)) as text:
        expected = await _post(text.url, path, {**body, "cache_salt": uuid.uuid4().hex}, request_id)
    async with running_proxy(_config(pair, True)) as once:
        moved_before = external_tokens(pair)
        got = await _post(once.url, path, {**body, "cache_salt": uuid.uuid4().hex}, request_id)
        rendered = once.state.metrics.registry.get_sample_value(
            "pdproxy_render_once_requests_total", {"served": "rendered"}
        )
    assert rendered == 1
    assert external_tokens(pair) > moved_before  # the decode read P's KV
    # "created" is the second of each answer: set to 0 on both sides (the JSON stays valid)
    got, expected = _CREATED.sub(b'"created":0', got), _CREATED.sub(b'"created":0', expected)
    if stream and got.count(b"\n\n") != expected.count(b"\n\n"):
        # vLLM merged some tokens' deltas into one chunk on one path (its output collector
        # does when the API server lags: timing, on either path): compare with the token
        # chunks merged, each chunk's bytes apart from its text, and the other chunks whole
        assert _merged(got) == _merged(expected)
    else:
        assert got.split(b"\n") == expected.split(b"\n")
    assert b"Paris" in got


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_cached_tokens_are_the_prefills_hit(pair, stream):
    body = {
        **_body(pair, COMPLETIONS, stream=stream),
        "prompt": STORY,
        "max_tokens": 4,
        "cache_salt": uuid.uuid4().hex,  # a cache of its own: nothing cached before
    }
    async with running_proxy(_config(pair, True)) as once:
        first = await _post(once.url, COMPLETIONS, body, uuid.uuid4().hex)
        hits_before = pair.prefill.metric("vllm:prefix_cache_hits_total")
        second = await _post(once.url, COMPLETIONS, body, uuid.uuid4().hex)
    prefill_hit = pair.prefill.metric("vllm:prefix_cache_hits_total") - hits_before
    assert _usage(first, stream=stream)["prompt_tokens_details"]["cached_tokens"] == 0
    usage = _usage(second, stream=stream)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == prefill_hit, (usage, prefill_hit)
    assert cached >= BLOCK and cached % BLOCK == 0
    assert cached < usage["prompt_tokens"]
