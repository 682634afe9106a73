"""Pre-warmed pairs (``--warm-pairs``) against sims: each new instance runs one tiny PD
request with at most K peers before it is routable, and none of it counts as client traffic."""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import pytest

from engines.sim import SimConfig, running_sim
from pdproxy.config.resilience import HealthConfig
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.membership.warmup import WARMUP_ID_PREFIX, PairWarmer
from pdproxy.types import Endpoint, EndpointState, EngineAddress, Role, Source
from tests.integration.conftest import MODEL, deployment


def _warmups(engine) -> list:
    return [
        r
        for r in engine.generation_requests()
        if r.headers.get("x-request-id", "").startswith(WARMUP_ID_PREFIX)
    ]


async def _routable(proxy, n_prefill: int, n_decode: int) -> None:
    for _ in range(500):
        snap = proxy.state.registry.snapshot()
        if len(snap.prefill) == n_prefill and len(snap.decode) == n_decode:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the instances did not become routable")


@pytest.mark.parametrize("connector", ["nixl", "mooncake"])
async def test_each_pair_is_warmed_once_before_routable_and_not_counted(connector):
    health = HealthConfig(interval=0, warm_pairs=2, warm_timeout=5)
    async with deployment(2, 2, connector, proxy={"health": health}) as d:
        snap = d.proxy.state.registry.snapshot()  # the start awaited the static warm-ups
        assert len(snap.prefill) == len(snap.decode) == 2
        # 2P2D, K=2: every one of the four pairs once (both ends asked, one run each)
        pairs = {(p.url, r.headers["x-request-id"]) for p in d.prefills for r in _warmups(p)}
        assert len(pairs) == 4
        assert all(len(_warmups(e)) == 2 for e in d.engines)
        assert all(r.status == 200 for e in d.engines for r in _warmups(e))
        async with aiohttp.ClientSession() as s, s.get(d.proxy.url + "/metrics") as r:
            metrics = await r.text()
        assert not re.search(r"^pdproxy_requests_total\{.*\} [1-9]", metrics, re.MULTILINE)
        assert all(e.legs.in_flight == 0 for e in d.proxy.state.registry.all())


async def test_a_warm_up_that_hangs_never_blocks_routability_beyond_its_timeout():
    health = HealthConfig(interval=0, warm_pairs=1, warm_timeout=0.5)
    async with deployment(1, 1, "nixl", proxy={"health": health}) as d:
        await _routable(d.proxy, 1, 1)
        d.prefills[0].set_faults(hang=True)
        async with running_sim(SimConfig(role="decode", connector="nixl", model=MODEL)) as new:
            started = time.monotonic()
            endpoint = await d.proxy.state.membership.add_admin(
                Role.DECODE, EngineAddress(url=new.url)
            )
            took = time.monotonic() - started
            assert endpoint.routable and 0.4 < took < 2, took
            assert len(_warmups(d.prefills[0])) == 2  # the start's, and the hung one


def test_peers_are_bounded_to_k_routable_first():
    registry = EndpointRegistry(clock=time.monotonic)
    peers = [
        Endpoint.new(
            role=Role.PREFILL, address=EngineAddress(url=f"http://p{i}"), source=Source.STATIC
        )
        for i in range(5)
    ]
    peers[0].presence.state = EndpointState.PENDING
    for e in peers:
        registry.add(e)
    new = Endpoint.new(
        role=Role.DECODE, address=EngineAddress(url="http://d"), source=Source.STATIC
    )
    registry.add(new)
    warmer = PairWarmer(
        HealthConfig(warm_pairs=3), registry=registry, client=None, connector=None, model="m"
    )
    chosen = warmer._chosen_peers(new)
    assert [e.url for e in chosen] == ["http://p1", "http://p2", "http://p3"]
