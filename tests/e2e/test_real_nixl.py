"""pdproxy in front of real vLLM CPU engines with the NIXL connector.

Tests share the session's tiny NIXL pair (tests/e2e/conftest.py) and each uses its own
prompts, so the decode's prefix cache never stands in for a transfer. The engine-kill test
stays last (the shared pair is restarted for whoever asks next).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import aiohttp
import orjson
import pytest

from pdproxy.config.proxy import ProxyConfig
from pdproxy.types import EngineAddress
from tests.e2e.conftest import external_tokens, output_text, post, wait_until
from tests.servers import running_proxy

pytestmark = pytest.mark.real_engine

TEXT = (
    "def schedule(requests, budget):\n    # pick the requests that fit in the token budget\n"
    "    chosen = []\n    for request in sorted(requests, key=len):\n"
)


def prompt(tag: str) -> str:
    return f"# case {tag}\n" + TEXT * 3


def proxy_config(pair) -> ProxyConfig:
    return ProxyConfig(
        prefill=(EngineAddress(url=pair.prefill_url),),
        decode=(EngineAddress(url=pair.decode_url),),
        kv_connector=pair.connector,
    )


def body(pair, kind: str, text: str, stream: bool, max_tokens: int = 16) -> dict:
    b = {"model": pair.model, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if kind == "chat":
        b["messages"] = [{"role": "user", "content": text}]
    else:
        b["prompt"] = text
    return b


def isolated(request: dict) -> dict:
    """A request that cannot reuse (or leave) prefix-cached blocks of other requests."""
    return {**request, "cache_salt": uuid.uuid4().hex}


def path(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
async def test_output_equals_single_engine_and_kv_moved(tiny_nixl, kind, stream):
    pair = tiny_nixl
    text = prompt(f"{kind}-{stream}")
    ext_before = external_tokens(pair)
    xfers_before = pair.decode.metric("vllm:nixl_xfer_time_seconds_count")
    async with running_proxy(proxy_config(pair)) as proxy:
        status, raw = await post(proxy.url, path(kind), body(pair, kind, text, stream))
    assert status == 200, raw
    moved = external_tokens(pair) - ext_before
    # the reference: the decode engine alone, as a plain engine (no kv_transfer_params); its
    # own cache salt keeps the transferred blocks in its prefix cache out of the reference
    ref_status, ref_raw = await post(
        pair.decode_url, path(kind), isolated(body(pair, kind, text, False))
    )
    assert ref_status == 200
    reference = orjson.loads(ref_raw)
    got = output_text(raw, chat=kind == "chat", stream=stream)
    assert got and got == output_text(ref_raw, chat=kind == "chat", stream=False)
    prompt_tokens = reference["usage"]["prompt_tokens"]
    assert prompt_tokens - 1 <= moved <= prompt_tokens, (moved, prompt_tokens)
    assert pair.decode.metric("vllm:nixl_xfer_time_seconds_count") > xfers_before


async def _tokens(pair, text: str) -> int:
    status, raw = await post(pair.decode_url, "/tokenize", {"model": pair.model, "prompt": text})
    assert status == 200
    return int(orjson.loads(raw)["count"])


async def _prefill_params(pair, text: str) -> dict:
    clamped = {**body(pair, "completions", text, False, max_tokens=1)}
    clamped["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    status, raw = await post(pair.prefill_url, "/v1/completions", clamped)
    assert status == 200
    return orjson.loads(raw)["kv_transfer_params"]


async def test_negative_control_other_prompts_kv_changes_output(tiny_nixl):
    """The decode given another prompt's params (same length) must not match: the KV is used."""
    pair = tiny_nixl
    candidates = [
        prompt(f"negative {n}") for n in ("alpha", "omega", "delta", "gamma", "sigma", "kappa")
    ]
    lengths = {c: await _tokens(pair, c) for c in candidates}
    a, b = next(
        (x, y) for x in candidates for y in candidates if x != y and lengths[x] == lengths[y]
    )
    params_a = await _prefill_params(pair, a)
    params_b = await _prefill_params(pair, b)
    _, raw_expected = await post(
        pair.prefill_url, "/v1/completions", isolated(body(pair, "completions", b, False))
    )
    expected_b = output_text(raw_expected, chat=False, stream=False)
    # each decode request gets its own cache salt: the first must not serve the second from
    # the decode's prefix cache
    positive = isolated({**body(pair, "completions", b, False), "kv_transfer_params": params_b})
    negative = isolated({**body(pair, "completions", b, False), "kv_transfer_params": params_a})
    _, raw_neg = await post(pair.decode_url, "/v1/completions", negative)
    _, raw_pos = await post(pair.decode_url, "/v1/completions", positive)
    assert output_text(raw_pos, chat=False, stream=False) == expected_b
    assert output_text(raw_neg, chat=False, stream=False) != expected_b


async def test_client_disconnect_mid_stream_aborts_decode(tiny_nixl):
    pair = tiny_nixl
    async with running_proxy(proxy_config(pair)) as proxy:
        session = aiohttp.ClientSession()
        # ignore_eos: the random model may stop early, and with each engine on its own core
        # a short answer can be over before the metric is read
        resp = await session.post(
            proxy.url + "/v1/completions",
            json={
                **body(pair, "completions", prompt("disconnect"), True, max_tokens=400),
                "ignore_eos": True,
            },
        )
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")
        assert pair.decode.metric("vllm:num_requests_running") == 1
        resp.close()
        await session.close()
        took = await wait_until(
            lambda: pair.decode.metric("vllm:num_requests_running") == 0, timeout=10
        )
        print(f"decode stopped generating {took:.2f} s after the client disconnected")
        assert all(e.legs.in_flight == 0 for e in proxy.state.registry.all())


async def test_prefill_kv_without_decode_is_freed_by_the_lease(tiny_nixl, record_property):
    """A disconnect between the legs leaves P's blocks pinned until the NIXL lease expires."""
    pair = tiny_nixl
    await wait_until(lambda: pair.prefill.metric("vllm:kv_cache_usage_perc") == 0, timeout=60)
    started = time.monotonic()
    await _prefill_params(pair, prompt("stranded"))
    assert pair.prefill.metric("vllm:kv_cache_usage_perc") > 0
    await wait_until(
        lambda: pair.prefill.metric("vllm:kv_cache_usage_perc") == 0, timeout=120, interval=0.5
    )
    held = time.monotonic() - started
    record_property("stranded_kv_seconds", round(held, 1))
    print(f"prefill held stranded KV blocks for {held:.1f} s (NIXL lease 30 s)")
    assert 20 <= held <= 90


async def _orphan_through(proxy, pair, tag: str) -> float:
    """One request whose decode leg fails (the dead decode): seconds until P is idle again."""
    await wait_until(lambda: pair.prefill.metric("vllm:kv_cache_usage_perc") == 0, timeout=60)
    status, _ = await post(
        proxy.url, "/v1/completions", isolated(body(pair, "c", prompt(tag), False))
    )
    assert status == 503  # the dead decode, no retry: the clock starts at the orphaning
    return await wait_until(
        lambda: pair.prefill.metric("vllm:kv_cache_usage_perc") == 0, timeout=60, interval=0.05
    )


async def test_orphaned_kv_is_released_within_two_seconds(tiny_nixl, record_property):
    """A prefill whose decode failed for good: pdproxy releases its KV through the live
    decode (a one-token leg while that decode is cold to pdproxy, then a leg vLLM rejects
    before admission, which makes it notify P), instead of the 30 s lease."""
    from engines.ports import free_port
    from pdproxy.config.resilience import HealthConfig, OutlierConfig, RetryConfig
    from pdproxy.config.scheduling import SchedulingConfig

    pair = tiny_nixl
    dead = EngineAddress(url=f"http://127.0.0.1:{free_port()}")
    config = ProxyConfig(
        prefill=(EngineAddress(url=pair.prefill_url),),
        decode=(dead, EngineAddress(url=pair.decode_url)),  # round robin: dead first
        kv_connector=pair.connector,
        # the default decode policy (least-loaded) would steer clear of the dead decode
        scheduling=SchedulingConfig(decode_policy="round-robin"),
        retry=RetryConfig(max_retries=0),
        health=HealthConfig(interval=0),
        outlier=OutlierConfig(consecutive_failures=0),
    )
    async with running_proxy(config) as proxy:
        cold = await _orphan_through(proxy, pair, "orphan-cold")
        status, _ = await post(
            proxy.url, "/v1/completions", isolated(body(pair, "c", prompt("warm"), False))
        )
        assert status == 200  # the live decode reads from P: pdproxy knows it is warm now
        warm = await _orphan_through(proxy, pair, "orphan-warm")
        released = proxy.state.metrics.registry.get_sample_value(
            "pdproxy_released_kv_total", {"outcome": "released"}
        )
    record_property("orphaned_kv_seconds_cold_decode", round(cold, 2))
    record_property("orphaned_kv_seconds_warm_decode", round(warm, 2))
    print(f"orphaned KV released in {cold:.2f} s (cold decode), {warm:.2f} s (warm decode)")
    assert released == 2
    assert cold <= 2.0 and warm <= 2.0
    assert pair.decode.metric("vllm:num_requests_running") == 0
    assert pair.decode.metric("vllm:num_requests_waiting") == 0


async def test_killed_engine_gives_a_clear_error_not_a_hang(tiny_nixl):
    """Must run last in this module: it kills the decode engine."""
    pair = tiny_nixl
    async with running_proxy(proxy_config(pair)) as proxy:
        os.killpg(pair.decode.pid, signal.SIGKILL)
        await wait_until(lambda: not pair.decode.alive(), timeout=10)
        started = time.monotonic()
        status, raw = await asyncio.wait_for(
            post(proxy.url, "/v1/completions", body(pair, "completions", prompt("killed"), False)),
            30,
        )
        assert status == 503
        assert orjson.loads(raw)["error"]["type"] == "ServiceUnavailableError"
        assert time.monotonic() - started < 15
