"""pdproxy in front of a real vLLM CPU push pair (``NixlPushConnector``, issue 32).

A tiny push pair of its own (push and pull engines cannot pair), behind pdproxy with
``--kv-connector nixl-push --push-dispatch concurrent``: every stream's two legs go at once.
Shown on the real engines:

* answers equal the decode engine's own for completions, chat and the token-in endpoint,
  streamed (concurrent) and whole (serial), and the decode's external KV counter grows by
  the prompt: the KV was pushed, not recomputed;
* a client that leaves before its first token (the prefill stopped meanwhile) leaks nothing:
  the prefill leg is not cancelled, its write frees the decode, whose KV usage is back to 0
  and whose processes are idle within 10 s;
* a client that leaves after its first token, two requests with one id (the second gets 409),
  a prefill and a decode that refuse connections: answered or told, the decode idle;
* a prefill that hangs (SIGSTOP) past ``--prefill-timeout-secs`` strands its decode (vLLM's
  decode, aborted while it waits, keeps its blocks): the client is told (504), the decode is
  out of rotation in ``/status``, and once the prefill is back pdproxy's later leg (same id
  and prompt) is written into the parked registration: usage back to 0, CPU idle, the decode
  back in rotation.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from engines.ports import free_port
from engines.vllm.lifecycle import EnginePair, vllm_engines
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.resilience import HealthConfig
from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.config.upstream import Timeouts
from pdproxy.types import EngineAddress
from tests.e2e.conftest import SHARED_FLAGS, external_tokens, output_text, post, wait_until
from tests.e2e.test_real_nixl import isolated
from tests.servers import running_proxy

pytestmark = pytest.mark.real_engine

GENERATE = "/inference/v1/generate"
TEXT = "A proxy sends both legs at once and the prefill writes the cache into the decode. " * 3
_TICKS = os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def push_pair() -> Iterator[EnginePair]:
    with vllm_engines(connector="nixl-push", extra_args=SHARED_FLAGS) as pair:
        yield pair


def _config(pair: EnginePair, **changes) -> ProxyConfig:
    return ProxyConfig(
        prefill=(EngineAddress(url=pair.prefill_url),),
        decode=(EngineAddress(url=pair.decode_url),),
        kv_connector="nixl-push",
        push_dispatch="concurrent",
        **changes,
    )


def _body(pair: EnginePair, kind: str, text: str, stream: bool, tokens: list[int] | None = None):
    if kind == "generate":
        params = {"max_tokens": 12, "temperature": 0}
        return {
            "model": pair.model,
            "token_ids": tokens,
            "sampling_params": params,
            "stream": stream,
        }
    body = {"model": pair.model, "max_tokens": 12, "temperature": 0, "stream": stream}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


def _path(kind: str) -> str:
    return {"generate": GENERATE, "chat": "/v1/chat/completions"}.get(kind, "/v1/completions")


def _answer(raw: bytes, kind: str, stream: bool) -> object:
    if kind != "generate":
        return output_text(raw, chat=kind == "chat", stream=stream)
    if not stream:
        return [t for c in orjson.loads(raw)["choices"] for t in c["token_ids"]]
    events = [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
    return [t for e in events for c in e.get("choices", []) for t in c.get("token_ids") or []]


def _cpu_seconds(pid: int) -> float:
    """CPU time of every process in the engine's group (its API server and engine core)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pid:  # pgrp: the engine was started in a session of its own
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _TICKS


async def _idle(pair: EnginePair) -> None:
    """Within 10 s: the decode's KV usage is 0 and its processes use under 5 % of a core."""
    await wait_until(lambda: pair.decode.metric("vllm:kv_cache_usage_perc") == 0, timeout=10)
    for _ in range(10):
        before = _cpu_seconds(pair.decode.pid)
        await asyncio.sleep(1.0)
        if _cpu_seconds(pair.decode.pid) - before < 0.05:
            return
    raise AssertionError("the decode engine kept stepping")


async def _learned(url: str, pair: EnginePair) -> None:
    """One serial request teaches pdproxy the prefill's NIXL side."""
    status, raw = await post(url, "/v1/completions", isolated(_body(pair, "text", TEXT, False)))
    assert status == 200, raw


@pytest.mark.parametrize("kind", ["completions", "chat", "generate"])
async def test_push_answers_equal_the_decodes_own_and_the_kv_is_pushed(push_pair, kind):
    pair = push_pair
    tokens = None
    if kind == "generate":
        status, raw = await post(
            pair.decode_url, "/tokenize", {"model": pair.model, "prompt": TEXT}
        )
        tokens = orjson.loads(raw)["tokens"]
    async with running_proxy(_config(pair)) as proxy:
        await _learned(proxy.url, pair)
        registry = proxy.state.metrics.registry
        for stream in (True, False):
            text = f"{kind} {stream}: {TEXT}"
            if tokens is None:
                body = isolated(_body(pair, kind, text, stream))
            else:  # a first token of its own: no block of it is cached anywhere yet
                body = _body(pair, kind, text, stream, [13 + stream, *tokens])
            before = external_tokens(pair)
            concurrent = registry.get_sample_value(
                "pdproxy_push_transfers_total", {"dispatch": "concurrent"}
            )
            status, raw = await post(proxy.url, _path(kind), body)
            assert status == 200, raw
            moved = external_tokens(pair) - before
            alone = {**body, "stream": False}
            if tokens is None:
                alone = isolated(alone)
            ref_status, ref_raw = await post(pair.decode_url, _path(kind), alone)
            assert ref_status == 200, ref_raw
            reference = orjson.loads(ref_raw)
            assert _answer(raw, kind, stream) == _answer(ref_raw, kind, False)
            prompt_tokens = reference["usage"]["prompt_tokens"]
            assert prompt_tokens - 1 <= moved <= prompt_tokens, (moved, prompt_tokens)
            after = registry.get_sample_value(
                "pdproxy_push_transfers_total", {"dispatch": "concurrent"}
            )
            assert (after or 0) - (concurrent or 0) == (1 if stream else 0)
    await _idle(pair)


async def test_a_client_that_leaves_before_its_first_token_leaks_nothing(push_pair):
    pair = push_pair
    async with running_proxy(_config(pair)) as proxy:
        await _learned(proxy.url, pair)
        os.kill(pair.prefill.pid, signal.SIGSTOP)  # both legs sent; no write yet
        try:
            async with aiohttp.ClientSession() as session:
                body = isolated(_body(pair, "completions", "leave: " + TEXT, True))
                task = asyncio.create_task(session.post(proxy.url + "/v1/completions", json=body))
                await asyncio.sleep(1.0)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            await asyncio.sleep(0.5)
        finally:
            os.kill(pair.prefill.pid, signal.SIGCONT)
        await _idle(pair)
        await wait_until(
            lambda: proxy.state.orchestrator.push_status()["request_ids_held"] == 0, 10
        )


async def test_a_hung_prefill_strands_its_decode_until_a_later_leg_heals_it(push_pair):
    pair = push_pair
    timeouts = Timeouts(prefill=2.0, push_wait=2.0)
    # slower than the request's first leg, so the stopped prefill is still picked
    health = HealthConfig(interval=2.0, timeout=1.0, failure_threshold=1, success_threshold=1)
    config = _config(pair, timeouts=timeouts, health=health)
    async with running_proxy(config) as proxy:
        await _learned(proxy.url, pair)
        os.kill(pair.prefill.pid, signal.SIGSTOP)
        try:
            body = isolated(_body(pair, "completions", "hang: " + TEXT, True))
            status, raw = await post(proxy.url, "/v1/completions", body, timeout=60)
            assert status == 504, raw  # told: the only prefill did not answer in time
            assert orjson.loads(raw)["error"]["type"] == "GatewayTimeoutError"
            decode = proxy.state.registry.get(pair.decode_url)
            assert proxy.state.outliers.stranded(decode)
            async with aiohttp.ClientSession() as s, s.get(proxy.url + "/status") as r:
                status_body = await r.json()
            assert [i["stranded"] for i in status_body["instances"] if i["role"] == "decode"] == [
                True
            ]
            assert status_body["push"]["healing"] == 1
            await asyncio.sleep(1.0)
            assert pair.decode.metric("vllm:kv_cache_usage_perc") > 0  # vLLM's leak
        finally:
            os.kill(pair.prefill.pid, signal.SIGCONT)
        started = time.monotonic()
        # Freed by pdproxy's later leg written into the parked registration (or, if vLLM ran
        # the timed-out first leg to its end before it saw the disconnect, by its write).
        await _idle(pair)
        await wait_until(lambda: not proxy.state.outliers.stranded(decode), timeout=10)
        assert time.monotonic() - started < 20
        await wait_until(lambda: proxy.state.orchestrator.push_status()["healing"] == 0, 10)
        status, raw = await post(proxy.url, "/v1/completions", isolated(body))
        assert status == 200, raw


async def test_a_client_that_leaves_after_its_first_token_leaks_nothing(push_pair):
    pair = push_pair
    async with running_proxy(_config(pair)) as proxy:
        await _learned(proxy.url, pair)
        body = {**isolated(_body(pair, "completions", "after: " + TEXT, True)), "max_tokens": 200}
        async with aiohttp.ClientSession() as session:
            resp = await session.post(proxy.url + "/v1/completions", json=body)
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")  # the first token came: the KV was written
            resp.close()
        await _idle(pair)


async def test_two_requests_with_one_id_one_is_refused(push_pair):
    pair = push_pair
    async with running_proxy(_config(pair)) as proxy:
        await _learned(proxy.url, pair)
        os.kill(pair.prefill.pid, signal.SIGSTOP)  # the first holds its id while both wait
        try:
            headers = {"X-Request-Id": "one-id-for-two"}
            first = asyncio.create_task(
                post(
                    proxy.url,
                    "/v1/completions",
                    isolated(_body(pair, "text", TEXT, True)),
                    headers=headers,
                )
            )
            await asyncio.sleep(0.5)
            second = await post(
                proxy.url,
                "/v1/completions",
                isolated(_body(pair, "text", TEXT, True)),
                headers=headers,
            )
        finally:
            os.kill(pair.prefill.pid, signal.SIGCONT)
        assert second[0] == 409 and orjson.loads(second[1])["error"]["type"] == "ConflictError"
        status, raw = await first
        assert status == 200, raw
        await _idle(pair)


async def test_a_refusing_prefill_or_decode_is_retried_and_leaks_nothing(push_pair):
    """A second prefill and a second decode that refuse connections (nothing listens): each
    leg sent there is retried on the real engine; every answer whole, the decode idle."""
    pair = push_pair
    dead = f"http://127.0.0.1:{free_port()}"
    config = ProxyConfig(
        prefill=(EngineAddress(url=pair.prefill_url), EngineAddress(url=dead)),
        decode=(EngineAddress(url=pair.decode_url), EngineAddress(url=dead)),
        kv_connector="nixl-push",
        push_dispatch="concurrent",
        health=HealthConfig(interval=0),  # both stay routable: the legs must meet them
        scheduling=SchedulingConfig(prefill_policy="round-robin", decode_policy="round-robin"),
    )
    async with running_proxy(config) as proxy:
        await _learned(proxy.url, pair)
        for i in range(6):
            body = isolated(_body(pair, "completions", f"refused {i}: {TEXT}", True))
            status, raw = await post(proxy.url, "/v1/completions", body)
            assert status == 200 and b'"error"' not in raw, raw[-300:]
        retries = proxy.state.metrics.registry.get_sample_value
        assert (retries("pdproxy_retries_total", {"leg": "prefill", "reason": "connect"}) or 0) + (
            retries("pdproxy_retries_total", {"leg": "decode", "reason": "connect"}) or 0
        ) >= 1
    await _idle(pair)
