"""``--first-token-from-prefill`` in front of a real vLLM CPU NIXL pair serving SmolLM2 (the
session's ``smollm2_nixl`` pair: ``--enable-scale-out --enable-prompt-tokens-details``,
``--block-size 32``).

* greedy streams through pdproxy with the flag equal the decode's own (alone, cold) token
  for token, for prompt lengths on both sides of the block size and on its multiples, on
  ``/inference/v1/generate``, and under ``--render-once`` on ``/v1/completions`` and
  ``/v1/chat/completions``; the first chunk is the decode's (its fields, in order);
* the requests off the edge were continued after t1 (the decode's prompt one token longer),
  the ones on a multiple took the usual decode, and the decode stayed healthy; its external
  KV counter grew for every request;
* the client's first token comes sooner than without the flag, in the same run.
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any

import aiohttp
import orjson
import pytest

from engines.vllm.launch import EnginePair
from pdproxy.config.proxy import ProxyConfig
from pdproxy.types import EngineAddress
from tests.e2e.conftest import external_tokens, post
from tests.servers import running_proxy

pytestmark = pytest.mark.real_engine

GENERATE = "/inference/v1/generate"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
BLOCK = 32
TEXT = (
    "The history of computing is a story of abstraction layered on abstraction. Early machines"
    " were programmed by rewiring panels; then came stored programs, assemblers, compilers,"
    " operating systems and networks, each hiding the one below. Modern inference servers"
    " split a request into a prefill that reads the prompt and a decode that writes the answer."
) * 6
# Lengths in the order sent: 32 and 33 bound the prefill's block size to 32 on the way.
LENGTHS = (32, 33, 31, 64, 65, 95, 96, 150, 160)


@pytest.fixture
def pair(smollm2_nixl: EnginePair) -> EnginePair:
    return smollm2_nixl


def _config(pair: EnginePair, **options: Any) -> ProxyConfig:
    return ProxyConfig(
        prefill=(EngineAddress(url=pair.prefill_url),),
        decode=(EngineAddress(url=pair.decode_url),),
        kv_connector=pair.connector,
        **options,
    )


async def _stream(url: str, path: str, body: dict[str, Any], rid: str) -> tuple[float, bytes]:
    """(seconds to the first chunk with a token, the whole stream)."""
    started, first, raw = time.perf_counter(), 0.0, b""
    timeout = aiohttp.ClientTimeout(total=120)
    async with (
        aiohttp.ClientSession(timeout=timeout) as s,
        s.post(url + path, json=body, headers={"X-Request-Id": rid}) as r,
    ):
        assert r.status == 200, await r.read()
        async for chunk in r.content.iter_any():
            if not first and (b'"token_ids":[' in chunk or b'"text":"' in chunk):
                first = time.perf_counter() - started
            raw += chunk
    return first, raw


def _events(raw: bytes) -> list[dict[str, Any]]:
    lines = [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert lines and lines[-1] == b"[DONE]", raw[-300:]
    return [orjson.loads(line) for line in lines[:-1]]


def _ids(raw: bytes) -> list[int]:
    return [t for e in _events(raw) for c in e["choices"] for t in c.get("token_ids") or []]


def _first_token_chunk(raw: bytes) -> bytes:
    """The stream's first chunk (re-dumped in its own key order), its token ids cut to one."""
    chunk = orjson.loads(raw.split(b"\n\n")[0][6:])
    choice = chunk["choices"][0]
    choice["token_ids"] = choice["token_ids"][:1]
    return orjson.dumps(chunk)


def _text(raw: bytes) -> str:
    def piece(choice: dict[str, Any]) -> str:
        return str(choice.get("text") or (choice.get("delta") or {}).get("content") or "")

    return "".join(piece(c) for e in _events(raw) for c in e["choices"])


def _usage(raw: bytes) -> dict[str, Any]:
    (usage,) = [e["usage"] for e in _events(raw) if e.get("usage")]
    return usage  # type: ignore[no-any-return]


async def _prompt_ids(pair: EnginePair, length: int) -> list[int]:
    status, raw = await post(pair.decode_url, "/tokenize", {"model": pair.model, "prompt": TEXT})
    assert status == 200, raw
    ids: list[int] = orjson.loads(raw)["tokens"]
    assert len(ids) >= length
    return ids[:length]


def _generate(pair: EnginePair, ids: list[int], salt: str, tokens: int = 12) -> dict[str, Any]:
    return {
        "model": pair.model,
        "token_ids": ids,
        "sampling_params": {"max_tokens": tokens, "temperature": 0},
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_salt": salt,
    }


def _decode_prompt_tokens(pair: EnginePair) -> float:
    return pair.decode.metric("vllm:prompt_tokens_total")


async def test_generate_streams_equal_the_decodes_own_on_and_off_the_block_edge(pair):
    seen: list[tuple[int, float, float]] = []
    async with running_proxy(_config(pair, first_token_from_prefill=True)) as proxy:
        for length in LENGTHS:
            ids = await _prompt_ids(pair, length)
            body = _generate(pair, ids, uuid.uuid4().hex)
            moved, prompts = external_tokens(pair), _decode_prompt_tokens(pair)
            rid = f"ft-{length}-{uuid.uuid4().hex[:8]}"
            _, got = await _stream(proxy.url, GENERATE, body, rid)
            seen.append(
                (length, external_tokens(pair) - moved, _decode_prompt_tokens(pair) - prompts)
            )
            reference_body = {**body, "cache_salt": uuid.uuid4().hex}  # the decode alone, cold
            _, reference = await _stream(pair.decode_url, GENERATE, reference_body, rid)
            assert _ids(got) == _ids(reference), length
            assert len(_ids(got)) == 12
            # the same chunk, wherever t1 came from (a loaded engine may put two tokens in
            # its first chunk: that chunk is compared on its first token)
            first, ref_first = (_first_token_chunk(raw) for raw in (got, reference))
            assert first == ref_first, length
            usage, ref_usage = _usage(got), _usage(reference)
            assert (usage["prompt_tokens"], usage["completion_tokens"]) == (length, 12)
            assert usage["total_tokens"] == ref_usage["total_tokens"]
    for length, moved, prompt in seen:
        assert moved >= length - 1, seen  # the decode read the prompt's KV every time
        on_edge = length % BLOCK == 0
        # off the edge the decode's prompt was prompt + [t1]; on it, the prompt (usual path)
        assert prompt == (length if on_edge else length + 1), seen
    async with aiohttp.ClientSession() as s, s.get(pair.decode_url + "/health") as r:
        assert r.status == 200  # the decode engine is alive


async def _chat_body(pair: EnginePair, url: str, multiple: bool) -> dict[str, Any]:
    """A chat whose rendered prompt is a multiple of the block size, or one past it."""
    for words in range(8, 80):
        content = " ".join(TEXT.split()[:words])
        body = {"model": pair.model, "messages": [{"role": "user", "content": content}]}
        status, raw = await post(url, "/v1/chat/completions/render", body)
        assert status == 200, raw
        length = len(orjson.loads(raw)["token_ids"])
        if (length % BLOCK == 0) == multiple:
            return body
    raise AssertionError("no chat of that length")


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_render_once_streams_equal_the_text_path_of_the_decode(pair, path):
    config = _config(pair, first_token_from_prefill=True, render_once=True)
    async with running_proxy(config) as proxy:
        warm = _generate(pair, await _prompt_ids(pair, 32), uuid.uuid4().hex)
        for length in (32, 33):  # bound the block size
            warm["token_ids"] = await _prompt_ids(pair, length)
            await _stream(proxy.url, GENERATE, warm, uuid.uuid4().hex)
        for case in ("off_edge", "multiple"):
            if path == CHAT:
                body = await _chat_body(pair, proxy.url, case == "multiple")
            else:
                length = 64 if case == "multiple" else 70
                body = {"model": pair.model, "prompt": await _prompt_ids(pair, length)}
            body.update(max_tokens=12, temperature=0, stream=True)
            body["stream_options"] = {"include_usage": True}
            moved = external_tokens(pair)
            _, got = await _stream(proxy.url, path, body, uuid.uuid4().hex)
            assert external_tokens(pair) > moved, case
            _, reference = await _stream(pair.decode_url, path, body, uuid.uuid4().hex)
            assert _text(got) == _text(reference), case
            usage, ref_usage = _usage(got), _usage(reference)
            counts = ("prompt_tokens", "completion_tokens", "total_tokens")
            assert [usage[k] for k in counts] == [ref_usage[k] for k in counts], case
    async with aiohttp.ClientSession() as s, s.get(pair.decode_url + "/health") as r:
        assert r.status == 200


async def test_first_token_comes_sooner_with_the_flag(pair):
    """TTFT with and without the flag in the same run, alternating (bench: docs/benchmarks.md)."""
    ids = await _prompt_ids(pair, 200)
    ttft: dict[bool, list[float]] = {False: [], True: []}
    async with (
        running_proxy(_config(pair)) as off,
        running_proxy(_config(pair, first_token_from_prefill=True)) as on,
    ):
        for length in (32, 33):  # bound the block size
            body = _generate(pair, await _prompt_ids(pair, length), uuid.uuid4().hex)
            await _stream(on.url, GENERATE, body, uuid.uuid4().hex)
        for i in range(16):
            for proxy in (on, off) if i % 2 else (off, on):  # neither always goes first
                body = _generate(pair, ids, uuid.uuid4().hex, tokens=4)
                first, _ = await _stream(proxy.url, GENERATE, body, uuid.uuid4().hex)
                ttft[proxy is on].append(first)
    off_ms, on_ms = (statistics.median(ttft[k]) * 1000 for k in (False, True))
    print(f"TTFT p50 without {off_ms:.1f} ms, with {on_ms:.1f} ms")
    assert on_ms <= off_ms - 20 or on_ms <= off_ms * 0.85, (off_ms, on_ms)
