"""The fault matrix in a fleet of two models: the matrix's 2P2D serving ``sim-model`` and a
third pair serving only ``other``. Whatever fails, a request's retry stays among the
instances serving its model (never the other pair, whose decode would refuse the KV),
and the matrix's invariants hold (harness.assert_settled)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from engines.sim import SimConfig, SimHandle, running_sim
from pdproxy.config.proxy import ProxyConfig
from pdproxy.types import EngineAddress
from tests.faults.harness import (
    HEALTH,
    OUTLIER,
    RETRY,
    TIMEOUTS,
    Fleet,
    all_ok,
    assert_settled,
    body,
    drive,
    idle,
    wait_until,
)
from tests.servers import running_proxy

pytestmark = pytest.mark.faults
OTHER = "other"


@dataclasses.dataclass
class TwoModels:
    fleet: Fleet  # its engines: the 2P2D, then the other pair
    other: tuple[SimHandle, SimHandle]


@contextlib.asynccontextmanager
async def two_models(**sim: object) -> AsyncIterator[TwoModels]:
    async with contextlib.AsyncExitStack() as stack:

        async def start(role: str, model: str) -> SimHandle:
            config = SimConfig(role=role, connector="nixl", model=model, strict=True, **sim)
            return await stack.enter_async_context(running_sim(config))

        prefills = [await start("prefill", "sim-model") for _ in range(2)]
        decodes = [await start("decode", "sim-model") for _ in range(2)]
        other = (await start("prefill", OTHER), await start("decode", OTHER))
        config = ProxyConfig(
            prefill=tuple(EngineAddress(url=s.url) for s in (*prefills, other[0])),
            decode=tuple(EngineAddress(url=s.url) for s in (*decodes, other[1])),
            kv_connector="nixl",
            timeouts=TIMEOUTS,
            health=dataclasses.replace(HEALTH, models_interval=0.05),
            outlier=OUTLIER,
            retry=RETRY,
        )
        proxy = await stack.enter_async_context(running_proxy(config))
        pools = proxy.state.registry.pools
        await wait_until(lambda: len(pools().by_model) == 2, timeout=4, what="models read")
        f = await idle(Fleet(proxy, [*prefills, other[0]], [*decodes, other[1]]))
        yield TwoModels(f, other)


def _untouched(pair: tuple[SimHandle, SimHandle]) -> bool:
    return not any(s.generation_requests() for s in pair)


@pytest.mark.parametrize(
    ("role", "faults"),
    [
        ("prefill", {"refuse_connections": True}),
        ("decode", {"refuse_connections": True}),
        ("decode", {"status": 503}),
        ("prefill", {"hang": True}),
        ("decode", {"reset_after_bytes": 0}),
    ],
)
async def test_retries_stay_with_the_model(role, faults):
    async with two_models() as m:
        f = m.fleet
        (f.prefills if role == "prefill" else f.decodes)[0].set_faults(**faults)
        all_ok(await drive(f, 12))
        assert _untouched(m.other)
        await assert_settled(f)


async def test_decode_killed_mid_stream_migrates_within_its_model():
    """Both of the model's decodes cut their streams after 3 tokens: each stream continues on
    the model's other decode (never the other model's) and completes (6 tokens: one
    migration), and past --migration-limit it ends with the error event."""
    async with two_models() as m:
        f = m.fleet
        for d in f.decodes[:2]:
            d.set_faults(close_after_tokens=3)
        all_ok(await drive(f, 4, stream=True))
        migrated = f.proxy.state.metrics.registry.get_sample_value(
            "pdproxy_migrations_total", {"reason": "reset", "outcome": "migrated"}
        )
        assert migrated == 4
        assert _untouched(m.other)
        await assert_settled(f)
        for d in f.decodes[:2]:
            d.set_faults(close_after_tokens=1)  # 6 tokens need 5 migrations: past the limit
        outcomes = await drive(f, 4, stream=True)
        assert all(o.status == 200 and o.error == "BadGatewayError" for o in outcomes)
        assert _untouched(m.other)
        await assert_settled(f)


async def test_the_models_only_decode_down_is_a_fast_503_and_the_other_model_serves():
    async with two_models() as m:
        f = m.fleet
        m.other[1].set_faults(health_status=503)
        gone = f.instance(m.other[1])
        await wait_until(lambda: not gone.routable, timeout=4, what="other's decode unhealthy")
        async with aiohttp.ClientSession() as session:
            payload = {**body(0, stream=False, chat=False), "model": OTHER}
            async with session.post(f.proxy.url + "/v1/completions", json=payload) as r:
                assert r.status == 503
                assert "'other'" in orjson.loads(await r.read())["error"]["message"]
        assert _untouched(m.other)
        all_ok(await drive(f, 8))
        await assert_settled(f)


async def test_client_leaves_mid_stream():
    async with two_models(decode_tps=50) as m:
        f = m.fleet
        async with aiohttp.ClientSession() as session:
            resp = await session.post(
                f.proxy.url + "/v1/completions",
                json=body(0, stream=True, chat=False, max_tokens=200),
            )
            await resp.content.readuntil(b"\n\n")
            resp.close()
        await assert_settled(f)
        outcomes = [r.outcome for d in f.decodes for r in d.generation_requests()]
        assert outcomes == ["client_disconnected"]
