"""pdproxy-register beside an engine that cannot announce itself (NIXL): the proxy's registry
follows the engine's life within the TTL."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import aiohttp

from engines.ports import free_port
from engines.sim import SimConfig, running_sim
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.registry import RegistryConfig
from tests.integration.conftest import MODEL
from tests.servers import running_proxy

TTL = 1.0


async def _sidecar(role: str, engine_url: str, registry: str):
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "engines.register",
        "--role",
        role,
        "--engine",
        engine_url,
        "--proxy",
        registry,
        "--interval-s",
        "0.2",
        stderr=asyncio.subprocess.DEVNULL,
    )


async def _until(predicate, timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


async def test_killed_engine_leaves_within_ttl_and_returns_on_restart():
    port = free_port()
    config = ProxyConfig(
        registry=RegistryConfig(port=port, host="127.0.0.1", ttl=TTL, sweep_interval=0.1)
    )
    registry = f"tcp://127.0.0.1:{port}"
    async with (
        running_proxy(config) as proxy,
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
    ):
        d_port = free_port()
        d_url = f"http://127.0.0.1:{d_port}"
        sidecars = [
            await _sidecar("prefill", p.url, registry),
            await _sidecar("decode", d_url, registry),
        ]
        try:
            reg = proxy.state.registry
            async with running_sim(SimConfig(role="decode", model=MODEL, port=d_port)):
                await _until(
                    lambda: len(reg.snapshot().decode) == 1 and len(reg.snapshot().prefill) == 1, 10
                )
                async with (
                    aiohttp.ClientSession() as s,
                    s.post(
                        proxy.url + "/v1/completions",
                        json={"model": MODEL, "prompt": "hi there", "max_tokens": 3},
                    ) as r,
                ):
                    assert r.status == 200
            # the decode engine is gone: its sidecar stops, the entry expires within the TTL
            gone = await _until(lambda: reg.get(d_url) is None, TTL + 1)
            assert gone <= TTL + 0.2 + 0.3  # TTL + one heartbeat interval + sweep slack
            assert reg.get(p.url) is not None
            async with running_sim(SimConfig(role="decode", model=MODEL, port=d_port)):
                await _until(lambda: len(reg.snapshot().decode) == 1, 5)  # restarted: it returns
        finally:
            for proc in sidecars:
                proc.send_signal(signal.SIGTERM)
            assert [await asyncio.wait_for(proc.wait(), 10) for proc in sidecars] == [0, 0]
