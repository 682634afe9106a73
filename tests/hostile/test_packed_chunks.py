"""A decode that packs several tokens into each stream chunk, then dies (issue 29): the
migrated continuation asks exactly what is left, and usage says what was delivered.

vLLM packs several tokens into one chunk under load or speculative decoding; a text
stream's chunks carry no count unless the client asked ``continuous_usage_stats``.
Counted one a chunk, 9 tokens in 3 chunks made the continuation ask for 17 tokens instead
of 11 (a client asking for 20 could get 26), and usage said 6 completion tokens where 12
were delivered. pdproxy now has an engine count the delivered text (``/tokenize``) once
per migration. Raw-socket engines (tests/hostile/hostile_engine.py) in front of a real
pdproxy, ``/health`` probed all along.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson
import pytest

from tests.hostile.hostile_engine import (
    MODEL,
    Exchange,
    HealthProbe,
    Writer,
    chunk,
    fleet,
    good_prefill,
    head,
    own_answer,
    whole,
)

WORDS = [f" w{i}" for i in range(9)]
SSE_HEAD = head(b"200 OK", b"content-type: text/event-stream", b"transfer-encoding: chunked")


def _event(text: str, **extra: Any) -> bytes:
    body = {"id": "cmpl-packed", "object": "text_completion", "created": 0, "model": MODEL}
    choices = [{"index": 0, "text": text, "finish_reason": None}] if text else []
    return chunk(b"data: " + orjson.dumps({**body, "choices": choices, **extra}) + b"\n\n")


TOKENIZE_FAULT: list[str] = []  # the fault case's: how /tokenize fails ("5xx", "hang")


async def _tokenize(exchange: Exchange, writer: Writer) -> None:
    """vLLM's /tokenize on the sims' model: a token a word (or the case's fault)."""
    if TOKENIZE_FAULT == ["hang"]:
        await asyncio.sleep(30)
    if TOKENIZE_FAULT == ["5xx"]:
        writer.write(whole(b'{"error":"down"}', status=b"503 Service Unavailable"))
        return await writer.drain()
    count = len(exchange.json["prompt"].split())
    writer.write(whole(orjson.dumps({"count": count, "tokens": list(range(count))})))
    await writer.drain()


async def packer(exchange: Exchange, writer: Writer) -> None:
    """Three tokens a chunk, three chunks, then the connection drops mid-stream."""
    if exchange.path == "/tokenize":
        return await _tokenize(exchange, writer)
    if not exchange.prompt.startswith("attack"):
        writer.write(own_answer(exchange))
        return await writer.drain()
    writer.write(SSE_HEAD + b"".join(_event("".join(WORDS[i : i + 3])) for i in (0, 3, 6)))
    await writer.drain()
    writer.transport.abort()


async def continuer(exchange: Exchange, writer: Writer) -> None:
    """Answers a continuation with three tokens in one chunk and vLLM's usage chunk."""
    if exchange.path == "/tokenize":
        return await _tokenize(exchange, writer)
    if not exchange.prompt.startswith("attack"):
        writer.write(own_answer(exchange))
        return await writer.drain()
    usage = {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
    writer.write(SSE_HEAD + _event(" x0 x1 x2") + _event("", usage=usage))
    writer.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    await writer.drain()


@pytest.mark.parametrize("asked_usage", [False, True], ids=["plain", "include_usage"])
async def test_a_migrated_stream_of_packed_chunks_asks_exactly_what_is_left(
    asked_usage: bool,
) -> None:
    payload: dict[str, Any] = {"model": MODEL, "prompt": "attack 0", "max_tokens": 20}
    payload["stream"] = True
    if asked_usage:
        payload["stream_options"] = {"include_usage": True}
    async with (
        fleet(prefill=good_prefill, decode=[packer, continuer]) as f,
        HealthProbe(f.proxy.url) as health,
        aiohttp.ClientSession() as session,
    ):
        async with session.post(f.proxy.url + "/v1/completions", json=payload) as r:
            assert r.status == 200
            body = await r.read()
        bystander = {"model": MODEL, "prompt": "bystander", "max_tokens": 4}
        async with session.post(f.proxy.url + "/v1/completions", json=bystander) as r:
            assert r.status == 200
            assert orjson.loads(await r.read())["choices"][0]["text"] == "bystander|bystander"
    health.assert_fast(at_least=1)
    continuation = next(
        e for e in f.decodes[1].exchanges if e.path == "/v1/completions" and e.stream
    )
    assert continuation.json["max_tokens"] == 11  # 20 - 9 delivered (was 17: 20 - 3 chunks)
    assert continuation.prompt == "attack 0" + "".join(WORDS)
    events = [orjson.loads(e[6:]) for e in body.split(b"\n\n") if e.startswith(b"data: {")]
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == "".join(WORDS) + " x0 x1 x2"
    assert b'"error"' not in body and body.endswith(b"data: [DONE]\n\n")
    usages = [e["usage"] for e in events if e.get("usage")]
    if asked_usage:  # 9 carried + the continuation's 3 (was 3 + 3)
        assert usages[-1]["completion_tokens"] == 12, usages


@pytest.mark.parametrize("fault", ["5xx", "hang"])
async def test_a_migration_whose_count_fails_falls_back_to_its_chunks(fault: str) -> None:
    """The fault matrix's row for the count: no engine answers /tokenize (5xx, or hangs
    past its 2 s), the continuation counts one token a chunk, as before, and the client's
    stream still ends whole."""
    TOKENIZE_FAULT[:] = [fault]
    payload = {"model": MODEL, "prompt": "attack 0", "max_tokens": 20, "stream": True}
    try:
        async with (
            fleet(prefill=good_prefill, decode=[packer, continuer]) as f,
            aiohttp.ClientSession() as session,
        ):
            started = time.monotonic()
            async with session.post(f.proxy.url + "/v1/completions", json=payload) as r:
                assert r.status == 200
                body = await r.read()
            assert time.monotonic() - started < 10
            active = f.proxy.state.metrics.registry.get_sample_value("pdproxy_requests_in_flight")
    finally:
        TOKENIZE_FAULT.clear()
    continuation = next(
        e for e in f.decodes[1].exchanges if e.path == "/v1/completions" and e.stream
    )
    assert continuation.json["max_tokens"] == 17  # 20 - 3 chunks: the fallback
    assert b'"error"' not in body and body.endswith(b"data: [DONE]\n\n")
    assert not active
