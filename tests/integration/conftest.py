from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import pytest

from engines.sim import SimConfig, running_sim
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.types import EngineAddress
from tests.servers import running_proxy

MODEL = "sim-model"
# These tiers test the request path, so they spread requests in a known order; the
# policies have their own tests (tests/unit/scheduling, tests/integration/test_policies.py).
ROUND_ROBIN = SchedulingConfig(prefill_policy="round-robin", decode_policy="round-robin")


@contextlib.asynccontextmanager
async def deployment(
    n_prefill: int = 2,
    n_decode: int = 2,
    connector: str = "nixl",
    tmp_path=None,
    proxy=None,
    **sim_overrides,
):
    """n_prefill + n_decode sims, a reference single engine, and pdproxy in front."""
    kv_dir = str(tmp_path) if tmp_path is not None else None
    common = dict(connector=connector, kv_dir=kv_dir, model=MODEL, strict=True, **sim_overrides)
    async with contextlib.AsyncExitStack() as stack:
        prefills = [
            await stack.enter_async_context(running_sim(SimConfig(role="prefill", **common)))
            for _ in range(n_prefill)
        ]
        decodes = [
            await stack.enter_async_context(running_sim(SimConfig(role="decode", **common)))
            for _ in range(n_decode)
        ]
        single = await stack.enter_async_context(
            running_sim(SimConfig(role="both", connector=connector, model=MODEL))
        )
        config = ProxyConfig(
            prefill=tuple(EngineAddress(url=s.url) for s in prefills),
            decode=tuple(EngineAddress(url=s.url) for s in decodes),
            **{"kv_connector": connector, "scheduling": ROUND_ROBIN, **(proxy or {})},
        )
        proxy = await stack.enter_async_context(running_proxy(config))
        yield Deployment(proxy, prefills, decodes, single)


class Deployment:
    def __init__(self, proxy, prefills, decodes, single):
        self.proxy, self.prefills, self.decodes, self.single = proxy, prefills, decodes, single

    @property
    def engines(self):
        return self.prefills + self.decodes

    def generation_requests(self, sims):
        return [r for s in sims for r in s.generation_requests()]


@pytest.fixture
async def nixl_2p2d() -> AsyncIterator[Deployment]:
    async with deployment() as d:
        yield d
