"""A 2P2D fleet whose sims register themselves over ZMQ (heartbeats every 0.2 s, TTL 1 s)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from engines.ports import free_port
from engines.sim import SimConfig, running_sim
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.registry import RegistryConfig
from tests.faults.harness import (
    HEALTH,
    MODEL,
    OUTLIER,
    RETRY,
    TIMEOUTS,
    Fleet,
    idle,
    wait_until,
)
from tests.servers import running_proxy


@contextlib.asynccontextmanager
async def registered_fleet() -> AsyncIterator[Fleet]:
    port = free_port()
    sim = dict(
        connector="nixl",
        model=MODEL,
        strict=True,
        register=f"tcp://127.0.0.1:{port}",
        register_interval_s=0.2,
    )
    async with contextlib.AsyncExitStack() as stack:
        prefills = [
            await stack.enter_async_context(running_sim(SimConfig(role="prefill", **sim)))
            for _ in range(2)
        ]
        decodes = [
            await stack.enter_async_context(running_sim(SimConfig(role="decode", **sim)))
            for _ in range(2)
        ]
        config = ProxyConfig(
            kv_connector="nixl",
            registry=RegistryConfig(port=port, host="127.0.0.1", ttl=1.0, sweep_interval=0.1),
            timeouts=TIMEOUTS,
            health=HEALTH,
            outlier=OUTLIER,
            retry=RETRY,
        )
        proxy = await stack.enter_async_context(running_proxy(config))
        fleet = Fleet(proxy, prefills, decodes)

        def complete() -> bool:
            snap = proxy.state.registry.snapshot()
            return len(snap.prefill) == 2 and len(snap.decode) == 2

        await wait_until(complete, timeout=6, what="the sims registered and routable")
        yield await idle(fleet)
