"""The fault matrix for tokenize once (``--render-once`` with a ``--render`` pool): a render
server that fails, hangs or is gone is retried on another like a pass-through leg; with
none left the client gets one OpenAI-shaped error in time and no prefill is sent; the
matrix's invariants hold (``harness.assert_settled``)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from engines.sim import SimConfig, running_sim
from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.types import EngineAddress
from tests.faults.harness import MODEL, PROMPT, TIMEOUTS, Fleet, assert_settled, fleet

pytestmark = pytest.mark.faults

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RENDER = "/v1/chat/completions/render"
ROUND_ROBIN = SchedulingConfig(prefill_policy="round-robin", decode_policy="round-robin")


@contextlib.asynccontextmanager
async def _render_fleet() -> AsyncIterator[tuple[Fleet, list[Any]]]:
    async with contextlib.AsyncExitStack() as stack:
        renderers = [
            await stack.enter_async_context(running_sim(SimConfig(role="both", model=MODEL)))
            for _ in range(2)
        ]
        proxy = {
            "render_once": True,
            "render": tuple(EngineAddress(url=r.url) for r in renderers),
            "scheduling": ROUND_ROBIN,  # the failing render server is certainly picked
        }
        f = await stack.enter_async_context(fleet(proxy=proxy))
        yield f, renderers


def _chat(i: int, *, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"{PROMPT} {i}"}],
        "max_tokens": 6,
        "stream": stream,
    }
    return body


async def _post(s: aiohttp.ClientSession, url: str, body: dict[str, Any]):
    started = time.monotonic()
    async with s.post(url + CHAT, json=body) as r:
        return r.status, await r.read(), time.monotonic() - started


def _prefill_legs(f: Fleet) -> int:
    return sum(len(p.generation_requests()) for p in f.prefills)


@pytest.mark.parametrize(
    ("fault", "reason"),
    [({"status": 500}, "5xx"), ({"hang": True}, "timeout"), (None, "connect")],
    ids=["5xx", "hang", "gone"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_failing_render_server_is_retried_on_another(fault, reason, stream):
    async with _render_fleet() as (f, renderers):
        if fault is None:
            await renderers[0].kill()  # gone: connections refused
        else:
            renderers[0].set_faults(**fault)
        async with aiohttp.ClientSession() as s:
            for i in range(4):
                status, raw, seconds = await _post(s, f.proxy.url, _chat(i, stream=stream))
                assert status == 200, raw
                assert seconds < TIMEOUTS.read + 2.0
                if stream:
                    assert raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw
                else:
                    assert orjson.loads(raw)["object"] == "chat.completion"
        assert f.metric("pdproxy_retries_total", leg="decode", reason=reason) >= 1
        assert f.metric("pdproxy_render_once_requests_total", served="rendered") == 4
        await assert_settled(f)


@pytest.mark.parametrize(
    ("fault", "status", "error"),
    [
        ({"hang": True}, 504, "GatewayTimeoutError"),
        ({"status": 503}, 503, "ServiceUnavailableError"),  # the engine's own, relayed
    ],
    ids=["hang", "5xx"],
)
async def test_no_render_server_left_is_one_openai_error_and_no_prefill(fault, status, error):
    async with _render_fleet() as (f, renderers):
        for r in renderers:
            r.set_faults(**fault)
        async with aiohttp.ClientSession() as s:
            got, raw, seconds = await _post(s, f.proxy.url, _chat(0, stream=True))
        assert got == status, raw
        assert orjson.loads(raw)["error"]["type"] == error
        assert seconds < 3 * (TIMEOUTS.read + 1.0)  # every retry bounded
        assert _prefill_legs(f) == 0
        await assert_settled(f)


async def test_client_leaves_while_the_render_server_is_silent():
    async with _render_fleet() as (f, renderers):
        for r in renderers:
            r.set_faults(hang=True)
        async with aiohttp.ClientSession() as s:
            with contextlib.suppress(TimeoutError):
                async with s.post(
                    f.proxy.url + CHAT,
                    json=_chat(0, stream=False),
                    timeout=aiohttp.ClientTimeout(total=0.3),
                ) as r:
                    await r.read()
        await assert_settled(f)
        assert _prefill_legs(f) == 0
