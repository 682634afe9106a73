"""Retry scope per connector, through a real pdproxy: a pull connector's decode retry reuses
the prefill's answer only when the failed decode was never reached; every other decode
retry, and every retry of an id-embedding or concurrent connector, re-runs the pair with a
fresh transfer. Answers stay exactly a single engine's."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest

from pdproxy.config.resilience import HealthConfig
from tests.integration.conftest import MODEL, deployment
from tests.integration.test_id_connectors_e2e import CASES, _text, fleet

# Generous timeouts: a loaded two-core machine must never fail a healthy engine's probe.
FAST_HEALTH = {"health": HealthConfig(interval=0.2, timeout=2.0, failure_threshold=2)}


def _body(i: int, *, stream: bool = False, chat: bool = False) -> dict:
    text = f"retried request {i} must read exactly like a single engine's answer"
    body = {"model": MODEL, "max_tokens": 8, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return body


async def _same_as_single(session, proxy_url, single_url, i, *, stream=False, chat=False):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    async with session.post(proxy_url + path, json=_body(i, stream=stream, chat=chat)) as r:
        assert r.status == 200, await r.text()
        got = _text(await r.read(), chat, stream)
    async with session.post(single_url + path, json=_body(i, chat=chat)) as r:
        assert got == _text(await r.read(), chat, False)


def _metric(proxy, name, **labels) -> float:
    return proxy.state.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_nixl_decode_never_reached_reuses_the_prefill():
    async with deployment(1, 2, proxy=FAST_HEALTH) as d, aiohttp.ClientSession() as s:
        d.decodes[0].set_faults(refuse_connections=True)
        for i in range(6):
            await _same_as_single(s, d.proxy.url, d.single.url, i, stream=i % 2 == 0)
        assert len(d.prefills[0].generation_requests()) == 6  # one prefill per request
        assert _metric(d.proxy, "pdproxy_retries_total", leg="decode", reason="connect") >= 1
        assert d.decodes[1].counters.kv_load_failures == 0


async def test_nixl_decode_that_may_have_read_the_kv_reruns_the_pair():
    async with deployment(1, 2, proxy=FAST_HEALTH) as d, aiohttp.ClientSession() as s:
        d.decodes[0].set_faults(status=503)
        for i in range(4):
            await _same_as_single(s, d.proxy.url, d.single.url, i)
        prefills = len(d.prefills[0].generation_requests())
        retries = _metric(d.proxy, "pdproxy_retries_total", leg="decode", reason="5xx")
        assert retries >= 1 and prefills == 4 + retries  # a fresh prefill per retry
        assert d.decodes[1].counters.kv_load_failures == 0


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c.dp_size == 1],
    ids=lambda c: f"{c.connector}-{c.register_format}-{c.transfer_mode}",
)
async def test_id_and_concurrent_connectors_retry_with_a_fresh_transfer(case):
    async with fleet(case) as (proxy, _, decodes, single), aiohttp.ClientSession() as s:
        bad = decodes[0]
        bad.set_faults(status=503)
        for i in range(6):
            await _same_as_single(s, proxy.url, single.url, i, stream=i % 2 == 1, chat=i % 3 == 0)
        assert _metric(proxy, "pdproxy_retries_total", leg="decode", reason="5xx") >= 1
        failed_ids = {r.headers["x-request-id"] for r in bad.generation_requests()}
        served_ids = {r.headers["x-request-id"] for r in decodes[1].generation_requests()}
        assert failed_ids and not failed_ids & served_ids  # every retry had a new id
        assert decodes[1].counters.kv_load_failures == 0


async def test_status_and_metrics_show_health_and_breakers():
    async with deployment(2, 2, proxy=FAST_HEALTH) as d, aiohttp.ClientSession() as s:
        d.decodes[0].set_faults(status=500)
        for i in range(8):
            await _same_as_single(s, d.proxy.url, d.single.url, i)
        async with s.get(d.proxy.url + "/status") as r:
            status = orjson.loads(await r.read())
        by_url = {i["url"]: i for i in status["instances"]}
        bad = by_url[d.decodes[0].url]
        assert bad["breaker"] in ("open", "half_open") and bad["ejections"] >= 1
        assert bad["health"] == "healthy"  # its /health is fine: only passive health saw it
        assert by_url[d.decodes[1].url]["routable"] is True
        async with s.get(d.proxy.url + "/metrics") as r:
            text = (await r.read()).decode()
        assert f'pdproxy_endpoint_ejected{{role="decode",url="{d.decodes[0].url}"}} 1.0' in text
        assert f'pdproxy_ejections_total{{role="decode",url="{d.decodes[0].url}"}}' in text
        assert 'pdproxy_retries_total{leg="decode",reason="5xx"}' in text
        assert f'pdproxy_endpoint_healthy{{role="prefill",url="{d.prefills[0].url}"}} 1.0' in text


async def test_static_instance_that_never_answers_is_not_routed_to():
    async with deployment(2, 2, proxy=FAST_HEALTH) as d, aiohttp.ClientSession() as s:
        d.prefills[1].set_faults(health_status=500)
        await _wait(lambda: not d.proxy.state.registry.get(d.prefills[1].url).routable)
        d.prefills[1].clear_requests()
        for i in range(4):
            await _same_as_single(s, d.proxy.url, d.single.url, i)
        assert d.prefills[1].generation_requests() == []


async def _wait(predicate, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def _p_idle(d) -> None:
    await _wait(lambda: d.prefills[0].gauges().kv_usage == 0, timeout=2.0)


@pytest.mark.parametrize("warm", [False, True], ids=["cold-decode", "warm-decode"])
async def test_orphaned_kv_is_released_not_left_to_the_lease(warm):
    """A decode fails after the prefill: its KV is released through the other decode (a
    one-token read while pdproxy has not seen it read from P, else a leg the decode rejects
    and that makes it notify P), well before the 30 s lease."""
    async with deployment(1, 2, proxy=FAST_HEALTH, kv_lease_s=30) as d:
        async with aiohttp.ClientSession() as s:
            if warm:  # one request per decode: both have read from P
                for i in range(2):
                    await _same_as_single(s, d.proxy.url, d.single.url, i)
            d.decodes[0].set_faults(status=503)
            await _same_as_single(s, d.proxy.url, d.single.url, 10)
        await _p_idle(d)
        assert _metric(d.proxy, "pdproxy_released_kv_total", outcome="released") == 1
        rejected = d.prefills[0].counters.kv_released_on_reject
        assert rejected == (1 if warm else 0)
        assert d.prefills[0].counters.kv_leases_expired == 0


async def test_no_release_when_the_decode_had_the_leg():
    """A client that leaves while its decode is opening: the decode aborts, vLLM frees P."""
    async with deployment(1, 2, proxy=FAST_HEALTH, kv_lease_s=30) as d:
        for dec in d.decodes:
            dec.set_faults(headers_delay_s=1)
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(s.post(d.proxy.url + "/v1/completions", json=_body(0)))
            await _wait(lambda: any(dec.generation_requests() for dec in d.decodes))
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await _wait(lambda: d.proxy.state.in_flight.count == 0)
        assert _metric(d.proxy, "pdproxy_released_kv_total", outcome="released") == 0
