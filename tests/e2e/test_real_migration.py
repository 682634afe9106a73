"""Mid-stream migration on real vLLM CPU engines serving SmolLM2-135M-Instruct: one prefill
and two decodes, this module's own (it kills one), started once for the module.

Three greedy streams start on the module's decode alone, through two pdproxies in front of
the same engines: the token-in path (``/inference/v1/generate``) and the text path's chat on
one, chat under ``--render-once`` on the other. The pair's decode is then added
through the admin API and the module's decode is SIGKILLed once every stream has about ten
tokens: every stream migrates to the other decode and arrives complete, the token-in and
render-once answers equal to a single engine's answer, the text path's complete (see
docs/fault-tolerance.md for where text continuation may differ).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from engines.vllm.engine import Engine, wait_healthy
from engines.vllm.launch import SMOLLM2, EnginePair, vllm_engines
from engines.vllm.lifecycle import extra_engine
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.resilience import HealthConfig
from pdproxy.config.upstream import Timeouts
from pdproxy.types import EngineAddress
from tests.e2e.conftest import SHARED_FLAGS, post, wait_until
from tests.servers import RunningProxy, running_proxy

pytestmark = pytest.mark.real_engine

CHAT = "/v1/chat/completions"
GENERATE = "/inference/v1/generate"
TOKENS = 64
CUT_AFTER = 10  # tokens each stream has when its decode is killed
KEY = "migration-admin-key"
QUESTION = "Write a long story about a lighthouse keeper and a storm at sea."


START_TIMEOUT = 900  # seconds: on a loaded two-core machine three start-ups take long


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[EnginePair, Engine]]:
    """A NIXL pair and a second decode (the one killed), with the session pairs' flags; the
    three start at once (the second decode is awaited once the pair is up)."""
    options: dict[str, Any] = {"model": SMOLLM2, "extra_args": SHARED_FLAGS}
    with (
        # on the pair's decode's core, never the prefill's: a decode busy-polling its KV fetch
        # on the prefill's core starved the prefill that must serve the read (one transfer
        # of 2.8 MB took 55 s, the next never ended; on core 1 it takes 2 ms)
        extra_engine("decode", cpu_bind="1", wait=False, **options) as doomed,
        vllm_engines(connector="nixl", timeout=START_TIMEOUT, **options) as pair,
    ):
        wait_healthy([doomed], timeout=START_TIMEOUT)
        yield pair, doomed


def _config(pair: EnginePair, decode: Engine, render_once: bool) -> ProxyConfig:
    return ProxyConfig(
        prefill=(EngineAddress(url=pair.prefill_url),),
        decode=(EngineAddress(url=decode.url),),
        kv_connector=pair.connector,
        render_once=render_once,
        admin_api_key=KEY,
        # three engines on two loaded cores answer probes slowly: only a dead one may fail them
        health=HealthConfig(timeout=30.0, failure_threshold=10),
        # and their first prefills too: three at once on a fresh prefill took over 30 s in
        # one CI run (504 before any stream began); the test is about the decode's death
        timeouts=Timeouts(prefill=180.0, decode_headers=180.0),
    )


@contextlib.asynccontextmanager
async def _proxies(pair: EnginePair, decode: Engine) -> AsyncIterator[list[RunningProxy]]:
    async with (
        running_proxy(_config(pair, decode, False)) as text,
        running_proxy(_config(pair, decode, True)) as rendered,
    ):
        yield [text, rendered]


def _chat(pair: EnginePair, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": pair.model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": TOKENS,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _generate(pair: EnginePair, ids: list[int], stream: bool) -> dict[str, Any]:
    return {
        "model": pair.model,
        "token_ids": ids,
        "sampling_params": {"max_tokens": TOKENS, "temperature": 0},
        "stream": stream,
    }


class _Stream:
    """One streamed answer, read as it comes: its events and the tokens counted so far."""

    def __repr__(self) -> str:
        first = f"the first at {self.first_at:.1f} s"
        return f"<{self.tokens} tokens, {first}, last events {self.events[-2:]}>"

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.tokens = 0
        self.first_at = float("nan")  # the test's clock (monotonic) when the first token came

    def feed(self, data: bytes) -> None:
        if data == b"[DONE]":
            return
        event = orjson.loads(data)
        self.events.append(event)
        for choice in event.get("choices") or ():
            ids = choice.get("token_ids")
            if isinstance(ids, list) and "delta" not in choice and "text" not in choice:
                self.tokens += len(ids)
            elif (choice.get("delta") or {}).get("content"):
                self.tokens += 1
        if self.tokens and math.isnan(self.first_at):
            self.first_at = time.monotonic()

    @property
    def text(self) -> str:
        return "".join(
            (c.get("delta") or {}).get("content") or ""
            for e in self.events
            for c in e.get("choices") or ()
        )

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events for c in e.get("choices") or () for t in c["token_ids"]]

    @property
    def errors(self) -> list[Any]:
        return [e["error"] for e in self.events if "error" in e]

    @property
    def usage(self) -> dict[str, Any] | None:
        usages = [e["usage"] for e in self.events if e.get("usage")]
        return usages[-1] if usages else None


async def _read(url: str, path: str, body: dict[str, Any], into: _Stream) -> None:
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as s, s.post(url + path, json=body) as r:
        assert r.status == 200, await r.read()
        async for line in r.content:
            if line.startswith(b"data: "):
                into.feed(line[6:].strip())


async def _add_decode(proxy: RunningProxy, url: str) -> None:
    body = {"type": "decode", "instance": url.removeprefix("http://")}
    async with (
        aiohttp.ClientSession() as s,
        s.post(proxy.url + "/instances/add", json=body, headers={"X-API-Key": KEY}) as r,
    ):
        assert r.status == 200, await r.text()


def _under_way(streams: dict[str, _Stream], readers: list[asyncio.Future[None]], n: int) -> bool:
    """Every stream has ``n`` tokens; a reader that ended before (an error status, a
    stream that ended) fails the test at once, with its reason, instead of a long wait."""
    for reader in readers:
        if reader.done():
            reader.result()  # raises the reader's failure
            raise AssertionError(f"a stream ended before {n} tokens: {streams}")
    return all(s.tokens >= n for s in streams.values())


def _routable(proxy: RunningProxy, url: str) -> bool:
    return any(e.url == url for e in proxy.state.registry.snapshot().decode)


async def test_a_killed_decode_s_streams_complete_on_the_other(
    engines: tuple[EnginePair, Engine],
) -> None:
    pair, doomed_decode = engines
    # the chat's prompt as token ids (its template applied), for the token-in path
    tokenize = {"model": pair.model, "messages": _chat(pair, False)["messages"]}
    status, raw = await post(pair.decode_url, "/tokenize", tokenize)
    assert status == 200, raw
    ids = orjson.loads(raw)["tokens"]
    # a single engine's answers (the pair's decode, alone)
    status, raw = await post(pair.decode_url, GENERATE, _generate(pair, ids, False))
    assert status == 200, raw
    want_ids = orjson.loads(raw)["choices"][0]["token_ids"]
    status, raw = await post(pair.decode_url, CHAT, _chat(pair, False))
    assert status == 200, raw
    answer = orjson.loads(raw)
    want_text = answer["choices"][0]["message"]["content"]
    assert len(want_ids) > CUT_AFTER + 5  # a long answer: the cut falls inside it

    async with _proxies(pair, doomed_decode) as (text, rendered):
        # the same three requests once, whole, on the doomed decode, so the streams' first
        # transfers and first shapes are not their first (CI once saw them begin 33 s apart,
        # with the decode then on the prefill's core, and the first end before the cut)
        warm = await asyncio.gather(
            post(text.url, GENERATE, _generate(pair, ids, False), 300),
            post(text.url, CHAT, _chat(pair, False), 300),
            post(rendered.url, CHAT, _chat(pair, False), 300),
        )
        assert [status for status, _ in warm] == [200] * 3, warm
        streams = {name: _Stream() for name in ("token-in", "text chat", "render-once chat")}
        readers = [
            asyncio.ensure_future(
                _read(text.url, GENERATE, _generate(pair, ids, True), streams["token-in"])
            ),
            asyncio.ensure_future(_read(text.url, CHAT, _chat(pair, True), streams["text chat"])),
            asyncio.ensure_future(
                _read(rendered.url, CHAT, _chat(pair, True), streams["render-once chat"])
            ),
        ]
        # every stream under way on the doomed decode (the only one) before the other joins
        await wait_until(lambda: _under_way(streams, readers, 1), 120, 0.02)
        for proxy in (text, rendered):
            await _add_decode(proxy, pair.decode_url)
        await wait_until(
            lambda: all(_routable(p, pair.decode_url) for p in (text, rendered)), timeout=30
        )
        await wait_until(lambda: _under_way(streams, readers, CUT_AFTER), 120, 0.02)
        cut_at = {name: s.tokens for name, s in streams.items()}
        os.killpg(doomed_decode.pid, signal.SIGKILL)
        await wait_until(lambda: not doomed_decode.alive(), 30)  # dead, and reaped
        await asyncio.wait_for(asyncio.gather(*readers), 300)

        for name, stream in streams.items():
            assert not stream.errors, (name, cut_at[name], stream.errors)
        assert cut_at["token-in"] < len(want_ids)  # the kill did fall mid-answer
        assert streams["token-in"].token_ids == want_ids
        assert streams["render-once chat"].text == want_text
        usage = streams["render-once chat"].usage
        want_usage = {k: answer["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
        assert usage is not None and {k: usage[k] for k in want_usage} == want_usage
        assert streams["text chat"].text.startswith(want_text[:20])
        for proxy, streamed in ((text, 2), (rendered, 1)):
            migrated = proxy.state.metrics.registry.get_sample_value(
                "pdproxy_migrations_total", {"reason": "reset", "outcome": "migrated"}
            )
            assert migrated == streamed, (proxy.url, migrated)
        print(f"cut at {cut_at}; text path equal: {streams['text chat'].text == want_text}")
