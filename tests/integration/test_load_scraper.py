"""LoadScraper against fake engines on loopback, and through a real pdproxy with sims."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import socket
import time

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry

from engines.sim import SimConfig, running_sim
from pdproxy.cli.main import parse_config
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.resilience import HealthConfig
from pdproxy.config.upstream import PoolLimits, Timeouts
from pdproxy.errors import ConfigError
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.membership.load_scraper import LoadScraper
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.types import Endpoint, EngineAddress, Role, Source
from pdproxy.upstream.engine_client import EngineClient
from tests.integration.conftest import MODEL, deployment
from tests.servers import running_proxy

PAGE = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
"""


class FakeEngine:
    """/metrics answering as ``mode`` says: ok, 500, garbage, missing, huge, hang, slow."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.headers: list[dict[str, str]] = []
        self.entered = asyncio.Event()  # a request reached the handler
        self.release = asyncio.Event()  # lets a "slow" or "hang" answer go

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        self.headers.append(dict(request.headers))
        self.entered.set()
        if self.mode in ("hang", "slow"):
            await self.release.wait()
        if self.mode == "500":
            return web.Response(status=500, text="Internal Server Error")
        if self.mode == "garbage":
            return web.Response(text="<html><body>not metrics</body></html>")
        if self.mode == "missing":
            return web.Response(text="# TYPE vllm:prompt_tokens_total counter\n")
        if self.mode == "huge":
            return web.Response(text=PAGE + "# padding " + "x" * (2 * 1024 * 1024) + "\n")
        return web.Response(text=PAGE)


@contextlib.asynccontextmanager
async def serving(engine: FakeEngine):
    app = web.Application()
    app.router.add_get("/metrics", engine.metrics)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        engine.release.set()
        await server.close()


@contextlib.asynccontextmanager
async def scraper_for(urls, *, interval=0.1, timeout=0.5, authorization=None):
    """A LoadScraper over a registry of decode endpoints at ``urls`` (not started)."""
    registry = EndpointRegistry(time.monotonic)
    for url in urls:
        registry.add(
            Endpoint.new(role=Role.DECODE, address=EngineAddress(url=url), source=Source.STATIC)
        )
    client = EngineClient(Timeouts(), PoolLimits(), authorization)
    await client.start()
    metrics = ProxyMetrics(CollectorRegistry())
    config = HealthConfig(timeout=timeout, engine_metrics_interval=interval)
    scraper = LoadScraper(
        config, registry=registry, client=client, metrics=metrics, clock=time.monotonic
    )
    try:
        yield scraper, registry, metrics
    finally:
        await scraper.aclose()
        await client.aclose()


def scrapes(metrics: ProxyMetrics, outcome: str) -> float:
    value = metrics.registry.get_sample_value("pdproxy_engine_scrapes_total", {"outcome": outcome})
    return value or 0.0


async def eventually(predicate, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def test_figures_land_on_the_endpoint_within_a_few_intervals():
    engine = FakeEngine()
    async with serving(engine) as url, scraper_for([url], interval=0.1) as (scraper, reg, m):
        endpoint = reg.get(url)
        scraper.start()
        await eventually(lambda: endpoint.load.engine_load is not None, within=2.0)
        load = endpoint.load.engine_load
        assert (load.running, load.waiting, load.kv_usage) == (4.0, 2.0, 0.75)
        assert [r.rank for r in load.ranks] == [0, 1]
        assert scraper.fresh(endpoint) is load
        first = load.scraped_at
        await eventually(lambda: endpoint.load.engine_load.scraped_at > first, within=2.0)
        assert scrapes(m, "ok") >= 2
        assert scrapes(m, "error") == 0


@pytest.mark.parametrize("mode", ["500", "garbage", "missing", "huge", "hang"])
async def test_a_failed_scrape_keeps_the_old_figures_and_counts_an_error(mode):
    engine = FakeEngine()
    async with serving(engine) as url, scraper_for([url], timeout=0.3) as (scraper, reg, m):
        endpoint = reg.get(url)
        await scraper.scrape(endpoint)
        before = endpoint.load.engine_load
        assert before is not None
        engine.mode = mode
        await scraper.scrape(endpoint)  # returns (bounded by the timeout) and does not raise
        assert endpoint.load.engine_load is before
        assert (scrapes(m, "ok"), scrapes(m, "error")) == (1, 1)


async def test_unreachable_engine_counts_an_error():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    async with scraper_for([url], timeout=0.3) as (scraper, reg, m):
        endpoint = reg.get(url)
        await scraper.scrape_all()
        assert endpoint.load.engine_load is None
        assert scrapes(m, "error") == 1


async def test_one_hung_engine_does_not_hold_up_the_others():
    hung, healthy = FakeEngine(), FakeEngine()
    hung.mode = "hang"
    async with (
        serving(hung) as hung_url,
        serving(healthy) as ok_url,
        scraper_for([hung_url, ok_url], timeout=0.3) as (scraper, reg, m),
    ):
        started = time.monotonic()
        await scraper.scrape_all()
        assert time.monotonic() - started < 2.0  # the hung one was cut off at its timeout
        assert reg.get(ok_url).load.engine_load is not None
        assert reg.get(hung_url).load.engine_load is None
        assert (scrapes(m, "ok"), scrapes(m, "error")) == (1, 1)


@pytest.mark.parametrize("replaced", [False, True])
async def test_an_endpoint_removed_during_its_scrape_is_not_written(replaced):
    engine = FakeEngine()
    engine.mode = "slow"
    async with serving(engine) as url, scraper_for([url]) as (scraper, reg, _):
        endpoint = reg.get(url)
        scrape = asyncio.create_task(scraper.scrape(endpoint))
        await asyncio.wait_for(engine.entered.wait(), 5)
        reg.remove(url)
        if replaced:
            reg.add(
                Endpoint.new(role=Role.DECODE, address=EngineAddress(url=url), source=Source.ADMIN)
            )
        engine.mode = "ok"
        engine.release.set()
        await asyncio.wait_for(scrape, 5)
        assert endpoint.load.engine_load is None
        if replaced:
            assert reg.get(url).load.engine_load is None


async def test_scrapes_carry_the_engine_api_key():
    engine = FakeEngine()
    async with (
        serving(engine) as url,
        scraper_for([url], authorization="Bearer engine-key") as (scraper, reg, _),
    ):
        await scraper.scrape(reg.get(url))
        assert engine.headers[-1].get("Authorization") == "Bearer engine-key"


async def test_interval_zero_turns_scraping_off():
    engine = FakeEngine()
    async with serving(engine) as url, scraper_for([url], interval=0.0) as (scraper, reg, _):
        assert not scraper.enabled and scraper.max_age == 0.0
        scraper.start()
        await asyncio.sleep(0.1)
        assert engine.headers == []
        assert reg.get(url).load.engine_load is None


def test_flag_env_var_and_validation():
    base = ["--prefill", "a:1", "--decode", "c:3"]
    assert parse_config(base, {}).health.engine_metrics_interval == 1.0
    env = {"PDPROXY_ENGINE_METRICS_INTERVAL_SECS": "0"}
    assert parse_config(base, env).health.engine_metrics_interval == 0.0
    assert parse_config([*base, "--engine-metrics-interval-secs", "2.5"], env).health == (
        HealthConfig(engine_metrics_interval=2.5)
    )
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ConfigError):
            HealthConfig(engine_metrics_interval=bad)


async def test_proxy_scrapes_sims_and_shows_the_figures():
    health = HealthConfig(engine_metrics_interval=0.1)
    async with deployment(1, 1, proxy={"health": health}) as d:
        endpoints = d.proxy.state.registry.all()
        await eventually(lambda: all(e.load.engine_load is not None for e in endpoints))
        async with aiohttp.ClientSession() as s, s.get(d.proxy.url + "/status") as r:
            status = await r.json()
        for instance in status["instances"]:
            load = instance["engine_load"]
            assert set(load) == {"running", "waiting", "kv_usage", "age_s", "ranks"}
            assert 0 <= load["age_s"] < 5
            assert load["ranks"][0]["rank"] == 0


async def forward(target: str, session: aiohttp.ClientSession, request: web.Request):
    """A front for a sim: everything is relayed but /metrics, which fails."""
    if request.path == "/metrics":
        return web.Response(status=500, text="metrics are broken")
    headers = {k: v for k, v in request.headers.items() if k.lower() == "content-type"}
    async with session.request(
        request.method, target + request.path_qs, data=await request.read(), headers=headers
    ) as answer:
        body = await answer.read()
        kind = answer.headers.get("Content-Type", "application/json")
        return web.Response(status=answer.status, body=body, headers={"Content-Type": kind})


@contextlib.asynccontextmanager
async def broken_metrics_front(target: str, session: aiohttp.ClientSession):
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", functools.partial(forward, target, session))
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def test_requests_succeed_while_every_scrape_fails():
    async with contextlib.AsyncExitStack() as stack:
        session = await stack.enter_async_context(aiohttp.ClientSession())
        fronts = []
        for role in ("prefill", "decode"):
            sim = await stack.enter_async_context(
                running_sim(SimConfig(role=role, model=MODEL, strict=True))
            )
            fronts.append(await stack.enter_async_context(broken_metrics_front(sim.url, session)))
        config = ProxyConfig(
            prefill=(EngineAddress(url=fronts[0]),),
            decode=(EngineAddress(url=fronts[1]),),
            health=HealthConfig(engine_metrics_interval=0.1),
        )
        proxy = await stack.enter_async_context(running_proxy(config))
        metrics = proxy.state.metrics
        await eventually(lambda: scrapes(metrics, "error") >= 4)
        body = {"model": MODEL, "prompt": "hello there", "max_tokens": 5, "temperature": 0}
        async with session.post(proxy.url + "/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["choices"][0]["text"]
        assert all(e.load.engine_load is None for e in proxy.state.registry.all())
        assert scrapes(metrics, "ok") == 0
