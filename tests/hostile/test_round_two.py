"""Hostile peers against the new features, round two (issue 29): registrations whose
templates, sizes or endpoints attack the registry, an engine listing 100,000 models, a
client key reaching the LoRA API, a lora_path outside the roots, a 200 KB model name.

Each case runs a real pdproxy with sims and real ZMQ DEALERs on loopback while ``/health``
is probed (``watched``: p99 under 100 ms, open files bounded).
"""

from __future__ import annotations

import asyncio

import aiohttp
import msgpack
import orjson
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from engines.ports import free_port
from engines.sim import SimConfig, running_sim
from pdproxy.config.lora import LoraConfig
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.registry import RegistryConfig
from pdproxy.config.scheduling import SchedulingConfig, template_fields_ok
from pdproxy.types import EngineAddress
from tests.hostile.test_instances import KEY, admin_pair, complete, watched
from tests.integration.conftest import MODEL
from tests.integration.test_registry import dealer, p2p
from tests.integration.test_registry_hardening import until, value

HOSTILE_TEMPLATES = [
    "tcp://{host.x}:5557",
    "tcp://{port[0]}:5557",
    "tcp://{host}:{port:>200000000}",
    "tcp://{host!r}:1",
    "tcp://{0}:1",
    "tcp://{host",
    "tcp://{__class__}:1",
]


@pytest.mark.parametrize("template", HOSTILE_TEMPLATES)
def test_a_template_is_checked_by_parsing_never_by_formatting(template):
    assert not template_fields_ok(template)
    assert template_fields_ok("tcp://{host}:{port}") and template_fields_ok("ipc:///x/{dp_rank}")


async def test_a_keyless_burst_of_hostile_registrations_never_takes_the_fleet_out():
    # Issue 29: an uncaught exception failed the registry's whole batch (backing off up to
    # 5 s); 800 such messages let the registered pair expire: 503 for 54 of 75 s.
    port = free_port()
    config = ProxyConfig(
        kv_connector="p2p-nccl",
        registry=RegistryConfig(port=port, host="127.0.0.1", ttl=2.0, sweep_interval=0.2),
        scheduling=SchedulingConfig(kv_events_endpoint="tcp://{host}:1"),
    )
    async with (
        running_sim(SimConfig(role="prefill", model=MODEL, connector="p2p-nccl")) as p,
        running_sim(SimConfig(role="decode", model=MODEL, connector="p2p-nccl")) as d,
        running_proxy_of(config) as proxy,
        # the test's own two ZMQ contexts (nine sockets, their I/O threads), the pair's KV
        # event subscribers and a session per request: about 60 files that come and go
        watched(proxy, fd_slack=100),
        dealer(f"tcp://127.0.0.1:{port}") as good,
    ):
        metrics = proxy.state.metrics

        async def heartbeats(stop: asyncio.Event) -> None:
            while not stop.is_set():
                await good.send(p2p("P", p))
                await good.send(p2p("D", d))
                await asyncio.sleep(0.3)

        stop = asyncio.Event()
        beating = asyncio.create_task(heartbeats(stop))
        registry = proxy.state.registry
        await until(  # both admitted (routable), not only heard of: else a first 503, by a race
            lambda: len(registry.snapshot().prefill) == 1 and len(registry.snapshot().decode) == 1
        )
        hostile = []
        for i, template in enumerate(HOSTILE_TEMPLATES * 3):
            hostile.append(
                msgpack.dumps(
                    {
                        "type": "P",
                        "http_address": f"127.0.0.{i % 200 + 2}:{9000 + i}",
                        "zmq_address": f"127.0.0.{i % 200 + 2}:{9000 + i}",
                        "kv_events_endpoint": template,
                    }
                )
            )
        context = zmq.asyncio.Context()  # one context: the test's own files stay few
        entered = []
        for _ in range(8):
            sock = context.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{port}")
            entered.append(sock)
        try:
            statuses = []
            for _ in range(20):  # 20 rounds of 8 connections x 21 messages, then a request
                for sock in entered:
                    for message in hostile:
                        await sock.send(message)
                statuses.append((await complete(proxy))[0])
                await asyncio.sleep(0.05)
        finally:
            for sock in entered:
                sock.close(0)
            context.term()
            stop.set()
            await beating
        assert statuses == [200] * 20  # the legitimate pair never left routing
        assert value(metrics.registry_messages, "error") == 0
        assert value(metrics.registry_messages, "malformed") > 0
        assert proxy.state.registry.get(p.url) is not None


async def test_sizes_and_foreign_kv_endpoints_of_a_registration_are_malformed():
    port = free_port()
    config = ProxyConfig(
        kv_connector="p2p-nccl",
        registry=RegistryConfig(port=port, host="127.0.0.1", max_dp_size=8),
        scheduling=SchedulingConfig(kv_events_endpoint="tcp://{host}:1"),
    )
    async with (
        running_sim(SimConfig(role="prefill", model=MODEL, connector="p2p-nccl")) as p,
        running_proxy_of(config) as proxy,
        watched(proxy, fd_slack=48),
        dealer(f"tcp://127.0.0.1:{port}") as sock,
    ):
        base = {"type": "P", "http_address": f"127.0.0.1:{p.port}", "zmq_address": "127.0.0.1:1"}
        bad = [
            {**base, "dp_size": 4096, "tp_size": 1, "transfer_mode": "READ"},  # 4,096 sockets
            {**base, "kv_events_endpoint": "ipc:///run/anything"},
            {**base, "kv_events_endpoint": "tcp://10.1.2.3:5557"},  # someone else's host
            {**base, "kv_events_replay_endpoint": "tcp://example.com:5558"},
        ]
        for message in bad:
            await sock.send(msgpack.dumps(message))
        metrics = proxy.state.metrics
        await until(lambda: value(metrics.registry_messages, "malformed") >= len(bad))
        assert proxy.state.registry.get(p.url) is None
        assert proxy.state.kv_events is None or not proxy.state.kv_events._running
        ok = {**base, "dp_size": 8, "tp_size": 1, "transfer_mode": "READ"}
        ok["kv_events_endpoint"] = "tcp://{host}:5557"
        await sock.send(msgpack.dumps(ok))
        await until(lambda: proxy.state.registry.get(p.url) is not None)


async def test_an_engine_listing_100000_models_is_not_admitted():
    async def models(_request: web.Request) -> web.Response:
        data = [{"id": f"m{i}", "object": "model"} for i in range(100_000)]
        return web.json_response({"object": "list", "data": data})

    app = web.Application(client_max_size=1 << 26)
    app.router.add_get("/v1/models", models)

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with admin_pair() as (proxy, _, _):
            body = {"type": "decode", "instance": f"127.0.0.1:{port}"}
            headers = {"X-API-Key": KEY}
            async with (
                aiohttp.ClientSession() as s,
                s.post(proxy.url + "/instances/add", json=body, headers=headers) as r,
            ):
                text = await r.text()
            assert 400 <= r.status < 500 and "--max-models-per-instance" in text, text
            assert len(proxy.state.registry.pools().by_model) == 1
            assert (await complete(proxy))[0] == 200
    finally:
        await runner.cleanup()


async def test_a_200_kb_model_name_is_not_echoed_whole():
    async with (
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        running_sim(SimConfig(role="decode", model=MODEL)) as d,
        running_proxy_of(
            ProxyConfig(prefill=(EngineAddress(url=p.url),), decode=(EngineAddress(url=d.url),))
        ) as proxy,
    ):
        await until(lambda: proxy.state.registry.pools().by_model)
        name = "x" * 200_000
        body = {"model": name, "prompt": "hi", "max_tokens": 2}
        async with (
            aiohttp.ClientSession() as s,
            s.post(proxy.url + "/v1/completions", json=body) as r,
        ):
            raw = await r.read()
        assert r.status == 404 and len(raw) < 1024, (r.status, len(raw))
        assert "200000 characters" in orjson.loads(raw)["error"]["message"]


def _lora_config(p, d, **extra) -> ProxyConfig:
    return ProxyConfig(
        prefill=(EngineAddress(url=p.url),),
        decode=(EngineAddress(url=d.url),),
        api_keys=("client-key",),
        admin_api_key=KEY,
        **extra,
    )


async def _lora(proxy, path: str, body: dict, headers: dict) -> tuple[int, dict]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(proxy.url + path, json=body, headers=headers) as r,
    ):
        raw = await r.read()
        return r.status, orjson.loads(raw) if r.status >= 400 else {"text": raw.decode()}


async def test_a_client_key_never_loads_or_unloads_adapters():
    lora = LoraConfig(modules=(("sql", "/models/sql"),), path_roots=("/models/adapters",))
    async with (
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        running_sim(SimConfig(role="decode", model=MODEL)) as d,
        running_proxy_of(_lora_config(p, d, lora=lora)) as proxy,
        watched(proxy),
    ):
        client = {"Authorization": "Bearer client-key"}
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            body = {"lora_name": "x", "lora_path": "/etc/shadow"}
            status, answer = await _lora(proxy, path, body, client)
            assert status == 403 and "error" in answer, (status, answer)
            status, _ = await _lora(proxy, path, body, {})
            assert status == 401
        assert not any(
            r.path.startswith("/v1/load") or r.path.startswith("/v1/unload")
            for s in (p, d)
            for r in s.requests
        )  # no engine was asked
        admin = {"Authorization": f"Bearer {KEY}"}
        for outside in ("/etc/shadow", "/models/adapters/../../etc/shadow", "relative/x"):
            body = {"lora_name": "x", "lora_path": outside}
            status, answer = await _lora(proxy, "/v1/load_lora_adapter", body, admin)
            assert status == 403 and "--lora-path-root" in answer["error"]["message"]
        inside = {"lora_name": "ok", "lora_path": "/models/adapters/ok"}
        assert (await _lora(proxy, "/v1/load_lora_adapter", inside, {"X-API-Key": KEY}))[0] == 200
        named = {"lora_name": "sql", "lora_path": "/models/sql"}
        assert (await _lora(proxy, "/v1/load_lora_adapter", named, admin))[0] == 200


def running_proxy_of(config: ProxyConfig):
    from tests.servers import running_proxy

    return running_proxy(config)
