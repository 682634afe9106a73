"""Hostile instances (issue 19, rows 4, 5 and 12): pdproxy's own address, the hop marker and
a real loop, unsendable registrations, a leg that cannot be built, and malformed admin input.

Each case runs against a real pdproxy (uvicorn on 127.0.0.1) with sim engines, real ZMQ
DEALERs on loopback and hostile HTTP engines, while ``/health`` is probed: its p99 stays
under 100 ms above a control server's, and the process's open files stay near where they
started.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgpack
import orjson
import pytest
from aiohttp import web
from multidict import CIMultiDict

from engines.ports import free_port
from engines.sim import SimConfig, running_sim
from pdproxy.cli.main import parse_config
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.registry import RegistryConfig
from pdproxy.config.resilience import HealthConfig
from pdproxy.types import EngineAddress
from tests import latency
from tests.hostile.control_health import running_control
from tests.integration.conftest import MODEL, ROUND_ROBIN
from tests.integration.test_registry import dealer
from tests.integration.test_registry_hardening import until, value
from tests.servers import RunningProxy, running_proxy
from tests.workers_harness import ADMIN_KEY, BODY, admin, status, workers_tree
from tests.workers_harness import complete as workers_complete

KEY = ADMIN_KEY  # the workers harness's, so one admin helper serves both
HEALTH_P99 = 0.1  # seconds
FD_SLACK = 64  # open files a case may leave or hold above its start
MIN_PROBES = 50
BURST = 10  # concurrent requests into the loop


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@contextlib.asynccontextmanager
async def watched(proxy: RunningProxy, fd_slack: int = FD_SLACK) -> AsyncIterator[dict[str, int]]:
    """Probe ``/health`` every 5 ms while the case runs; on exit its p99 must be under
    100 ms above a control's (``control_health``, probed right after each ``/health``: what
    the machine and this test's own event loop, pdproxy's too, add at that moment), and the
    open files (sampled at every probe) within ``fd_slack`` of the start."""
    latencies: list[float] = []
    controls: list[float] = []
    fds = {"start": open_fds(), "peak": open_fds()}
    stop = asyncio.Event()

    async def probe(control: str) -> None:
        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                started = time.perf_counter()
                async with session.get(proxy.url + "/health") as response:
                    await response.read()
                    assert response.status == 200
                latencies.append(time.perf_counter() - started)
                started = time.perf_counter()
                async with session.get(control) as response:
                    await response.read()
                controls.append(time.perf_counter() - started)
                fds["peak"] = max(fds["peak"], open_fds())
                await asyncio.sleep(0.005)

    with running_control() as port:
        task = asyncio.create_task(probe(f"http://127.0.0.1:{port}/"))
        try:
            yield fds
        finally:
            for _ in range(500):  # a quick case: enough probes for a p99 (at most 5 s more)
                if len(latencies) >= MIN_PROBES or task.done():
                    break
                await asyncio.sleep(0.01)
            stop.set()
            await asyncio.wait_for(task, 10)
    assert len(latencies) >= MIN_PROBES, latencies
    p99, control_p99 = latency.p99(latencies), latency.p99(controls)
    assert p99 < HEALTH_P99 + control_p99, (
        f"/health p99 {p99 * 1000:.1f} ms (the control's: {control_p99 * 1000:.1f} ms)"
    )
    assert fds["peak"] - fds["start"] < fd_slack, fds


@contextlib.asynccontextmanager
async def admin_pair() -> AsyncIterator[tuple[RunningProxy, Any, Any]]:
    """A 1P1D sim pair behind pdproxy with the admin API on, ``/health`` watched: the
    proxy, the prefill sim and the decode sim."""
    async with (
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        running_sim(SimConfig(role="decode", model=MODEL)) as d,
        running_proxy(
            ProxyConfig(
                prefill=(EngineAddress(url=p.url),),
                decode=(EngineAddress(url=d.url),),
                admin_api_key=KEY,
            )
        ) as proxy,
        watched(proxy),
    ):
        yield proxy, p, d


async def admin_add(proxy: RunningProxy, body: Any, raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else orjson.dumps(body)
    headers = {"X-API-Key": KEY, "Content-Type": "application/json"}
    async with (
        aiohttp.ClientSession() as session,
        session.post(proxy.url + "/instances/add", data=data, headers=headers) as response,
    ):
        text = await response.text()
    return response.status, text


async def complete(proxy: RunningProxy, **headers: str) -> tuple[int, dict[str, Any]]:
    body = {"model": MODEL, "prompt": "no loops, no poisoned instances", "max_tokens": 4}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.post(proxy.url + "/v1/completions", json=body, headers=headers) as response,
    ):
        return response.status, orjson.loads(await response.read())


def own_port(proxy: RunningProxy) -> int:
    return int(proxy.url.rsplit(":", 1)[1])


def aliases(port: int) -> list[str]:
    """pdproxy's own listener, spelled every way an instance address can be."""
    spellings = ["127.0.0.1", "localhost", "[::1]", "127.0.0.2", "127.1", "2130706433"]
    spellings += ["[::ffff:127.0.0.1]", "LocalHost", "a.localhost", socket.gethostname()]
    return [f"{host}:{port}" for host in spellings]


# -- row 4: pdproxy's own address ---------------------------------------------------------


async def test_own_address_refused_by_admin_under_every_alias():
    async with admin_pair() as (proxy, p, d):
        port = own_port(proxy)
        for instance in aliases(port):
            for role in ("prefill", "decode"):
                status, text = await admin_add(proxy, {"type": role, "instance": instance})
                assert status == 400 and "own listener" in text, (instance, text)
        for instance in (f"0.0.0.0:{port}", f"[::]:{port}"):
            status, text = await admin_add(proxy, {"type": "decode", "instance": instance})
            assert status == 400 and "routable" in text
        assert len(proxy.state.registry) == 2
        assert not p.generation_requests() and not d.generation_requests()


async def test_own_address_refused_at_registration_under_every_alias(caplog):
    caplog.set_level(logging.WARNING, logger="pdproxy")
    registry_port = free_port()
    config = ProxyConfig(registry=RegistryConfig(port=registry_port, host="127.0.0.1"))
    async with (
        running_proxy(config) as proxy,
        watched(proxy),
        dealer(f"tcp://127.0.0.1:{registry_port}") as sock,
    ):
        metrics = proxy.state.metrics
        port = own_port(proxy)
        for instance in aliases(port):
            kv = f"127.0.0.1:{free_port()}"
            for kind in ("P", "D"):
                msg = {"type": kind, "http_address": instance, "zmq_address": kv}
                await sock.send(msgpack.dumps(msg))
        legacy = {
            "type": "register",
            "role": "P",
            "request_address": f"http://localhost:{port}/v1/completions",
            "handshake_port": 6301,
            "notify_port": 61005,
            "transfer_mode": "READ",
        }
        await sock.send(msgpack.dumps(legacy))
        expected = 2 * len(aliases(port)) + 1
        await until(lambda: value(metrics.registry_messages, "refused") >= expected)
        unroutable = {"type": "D", "http_address": f"0.0.0.0:{port}", "zmq_address": "h:1"}
        await sock.send(msgpack.dumps(unroutable))
        await until(lambda: value(metrics.registry_messages, "malformed") >= 1)
        assert len(proxy.state.registry) == 0
        assert value(metrics.registry_messages, "refused") == expected
    refusals = [r for r in caplog.records if "own listener" in r.getMessage()]
    assert 1 <= len(refusals) <= 2  # rate-limited: a peer chooses how often


async def test_own_hop_is_refused_508_before_any_leg():
    async with (
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        running_sim(SimConfig(role="decode", model=MODEL)) as d,
        running_proxy(
            ProxyConfig(prefill=(EngineAddress(url=p.url),), decode=(EngineAddress(url=d.url),))
        ) as proxy,
        watched(proxy),
    ):
        own = f"1.1 pdproxy-{proxy.state.config.hop_id}"
        for via in (own, f"1.0 lb, {own}", f"{own}, 1.1 pdproxy-0000000000000000"):
            status, body = await complete(proxy, Via=via)
            assert status == 508 and body["error"]["type"] == "LoopDetectedError", body
        async with (
            aiohttp.ClientSession() as session,
            session.post(proxy.url + "/tokenize", json={"prompt": "x"}, headers={"Via": own}) as r,
        ):
            assert r.status == 508
        # Two Via lines, ours in the first: a later line does not hide it (RFC 9110 §5.3).
        body = {"model": MODEL, "prompt": "x", "max_tokens": 4}
        two_lines = CIMultiDict([("Via", own), ("Via", "1.0 lb")])
        async with (
            aiohttp.ClientSession() as session,
            session.post(proxy.url + "/v1/completions", json=body, headers=two_lines) as r,
        ):
            assert r.status == 508
        # no leg was sent (the sims saw only pdproxy's health checks, load scrapes, model reads)
        assert {r.path for r in (*p.requests, *d.requests)} <= {"/health", "/metrics", "/v1/models"}
        # Another pdproxy's hop is a chain of proxies: served, and forwarded with ours.
        status, _ = await complete(proxy, Via="1.1 pdproxy-0000000000000000")
        assert status == 200
        (leg,) = d.generation_requests()
        assert leg.headers["via"] == f"1.1 pdproxy-0000000000000000, {own}"
        assert p.generation_requests()[0].headers["via"] == leg.headers["via"]


@contextlib.asynccontextmanager
async def forwarder() -> AsyncIterator[tuple[str, dict[str, int]]]:
    """A TCP relay to pdproxy (a load balancer in front of it): an alias no address check
    can see through. ``target["port"]`` is set once pdproxy listens."""
    target = {"port": 0}

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target["port"])
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", target
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2)


@pytest.mark.parametrize("looped", ["prefill", "decode"])
async def test_a_real_loop_ends_at_the_first_hop(looped):
    """Issue 19 row 4: pdproxy as its own instance turned one request into 2,205 prefill
    legs and 4,095 open files in 5 s. Behind a relay no address check sees through; the hop
    marker ends it at the first return, the looped leg fails (and is retried) like any
    failing instance, and the open files stay where they were."""
    async with (
        forwarder() as (relay_url, target),
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        running_sim(SimConfig(role="decode", model=MODEL)) as d,
    ):
        prefill = relay_url if looped == "prefill" else p.url
        decode = relay_url if looped == "decode" else d.url
        config = ProxyConfig(
            prefill=(EngineAddress(url=prefill),),
            decode=(EngineAddress(url=decode),),
            health=HealthConfig(interval=0),  # its first probe would reach no pdproxy yet
        )
        async with running_proxy(config) as proxy:
            target["port"] = own_port(proxy)
            assert proxy.state.registry.snapshot().decode  # routable: the loop is live
            # A request in flight holds about 8 files here (its client's connection, the
            # leg to the relay, the relay's two ends, the looped request's connection);
            # the unbounded loop this guards against reached 4,095 in 5 s.
            async with watched(proxy, fd_slack=FD_SLACK + 8 * BURST):
                statuses = [(await complete(proxy))[0] for _ in range(5)]
                burst = await asyncio.gather(*(complete(proxy) for _ in range(BURST)))
        statuses += [status for status, _ in burst]
        assert all(status in (502, 503, 508) for status in statuses), statuses
        assert proxy.state.metrics.endpoint_requests  # legs went out: the loop was tried
        retries = proxy.state.config.retry.max_retries
        sent = p.generation_requests() if looped == "decode" else d.generation_requests()
        assert len(sent) <= len(statuses) * (retries + 1)  # one pass each, not a storm
        looped_legs = value(proxy.state.metrics.endpoint_requests, looped, relay_url)
        assert looped_legs <= len(statuses) * (retries + 1)


# -- row 5: registrations that cannot be sent, and legs that cannot be built --------------


@pytest.mark.parametrize(
    "zmq_address",
    ["127.0.0.1:21001\r\nX-Injected: 1", "127.0.0.1:2100\u20ac", "caf\u00e9:21001", "h\x00:1"],
)
async def test_unsendable_zmq_address_refused_at_decode(zmq_address):
    registry_port = free_port()
    config = ProxyConfig(
        kv_connector="p2p-nccl", registry=RegistryConfig(port=registry_port, host="127.0.0.1")
    )
    async with (
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        running_proxy(config) as proxy,
        watched(proxy),
        dealer(f"tcp://127.0.0.1:{registry_port}") as sock,
    ):
        message = {"type": "P", "http_address": f"127.0.0.1:{p.port}", "zmq_address": zmq_address}
        for _ in range(3):
            await sock.send(msgpack.dumps(message))
        metrics = proxy.state.metrics
        await until(lambda: value(metrics.registry_messages, "malformed") >= 3)
        assert proxy.state.registry.get(p.url) is None


@pytest.mark.parametrize(
    ("poisoned", "bad"),
    [("prefill", "127.0.0.1:1\r\nX-Injected: 1"), ("decode", "127.0.0.1:1\u20ac")],
)
async def test_unbuildable_leg_counts_against_its_instance_and_is_retried(poisoned, bad):
    """Issue 19 row 5: an instance whose zmq_address cannot go into the request id's header
    (here one that got in around the decoder: an embedder's config) made every request
    through it a 500, never counted against it. Now nothing is sent to it, the failure is
    its own (toward ejection, even when the leg was its peer's), and another serves."""
    sim = dict(connector="p2p-nccl", model=MODEL, strict=True, kv_wait_timeout_s=3.0)
    async with contextlib.AsyncExitStack() as stack:
        ps = [
            await stack.enter_async_context(running_sim(SimConfig(role="prefill", **sim)))
            for _ in range(2)
        ]
        ds = [
            await stack.enter_async_context(running_sim(SimConfig(role="decode", **sim)))
            for _ in range(2)
        ]

        def addresses(sims: list[Any], role: str) -> tuple[EngineAddress, ...]:
            kv = [bad if role == poisoned and i == 0 else s.zmq_address for i, s in enumerate(sims)]
            return tuple(
                EngineAddress(url=s.url, zmq_address=z) for s, z in zip(sims, kv, strict=True)
            )

        config = ProxyConfig(
            kv_connector="p2p-nccl",
            prefill=addresses(ps, "prefill"),
            decode=addresses(ds, "decode"),
            scheduling=ROUND_ROBIN,
        )
        proxy = await stack.enter_async_context(running_proxy(config))
        async with watched(proxy):
            statuses = [(await complete(proxy))[0] for _ in range(8)]
        assert statuses == [200] * 8
        victim = (ps if poisoned == "prefill" else ds)[0]
        assert not victim.generation_requests()  # nothing was ever sent to it
        metrics = proxy.state.metrics
        failures = value(metrics.endpoint_failures, poisoned, victim.url, "connect")
        assert failures >= 1
        assert value(metrics.retries, poisoned, "connect") == failures
        endpoint = proxy.state.registry.get(victim.url)
        assert endpoint is not None and endpoint.health.consecutive_failures >= 1
        peers, role = (ds, "decode") if poisoned == "prefill" else (ps, "prefill")
        assert not any(value(metrics.endpoint_failures, role, s.url, "connect") for s in peers)


# -- row 12: admin input --------------------------------------------------------------------


MALFORMED_ADDS = [
    {"type": "decode", "instance": "127.0.0.1:\u00b2"},
    {"type": "decode", "instance": "127.0.0.1:\u0668\u0660\u0660\u0660"},
    {"type": "decode", "instance": "127.0.0.1:\uff18\uff10"},
    {"type": ["decode"], "instance": "127.0.0.1:80"},
    {"type": {"decode": 1}, "instance": "127.0.0.1:80"},
    {"type": 1, "instance": "127.0.0.1:80"},
    {"type": None, "instance": "127.0.0.1:80"},
    {"type": "Decode", "instance": "127.0.0.1:80"},
    {"type": "decode", "instance": ["127.0.0.1:80"]},
    {"type": "decode", "instance": {"host": "127.0.0.1"}},
    {"type": "decode", "instance": True},
    {"type": "decode", "instance": None},
    {"type": "decode", "instance": "a" * 5000 + ":80"},
    {"type": "decode", "instance": "127.0.0.1:80\r\nX: y"},
    {"type": "decode", "instance": "caf\u00e9:80"},
    {"type": "decode", "instance": "0.0.0.0:80"},
    {"type": "decode", "instance": "127.0.0.1:80", "zmq_address": 5},
    {"type": "decode", "instance": "127.0.0.1:80", "zmq_address": ["a:1"]},
    {"type": "decode", "instance": "127.0.0.1:80", "zmq_address": "a:1\r\nX: y"},
    {"type": "decode", "instance": "127.0.0.1:80", "zmq_address": "a:1\u20ac"},
    {"type": "decode", "instance": "127.0.0.1:80", "zmq_address": ""},
    {"type": "decode", "instance": "127.0.0.1:80", "dp_size": "2"},
    {"type": "decode", "instance": "127.0.0.1:80", "dp_size": 2.5},
    {"type": "decode", "instance": "127.0.0.1:80", "dp_size": True},
    {"type": "decode", "instance": "127.0.0.1:80", "dp_size": 2**63},
    {"type": "decode", "instance": "127.0.0.1:80", "tp_size": [1]},
    {"type": "decode", "instance": "127.0.0.1:80", "transfer_mode": 5},
    {"type": "decode", "instance": "127.0.0.1:80", "transfer_mode": ["READ"]},
    {"type": "decode", "instance": "127.0.0.1:80", "bootstrap_port": "8998"},
    {"type": "decode", "instance": "127.0.0.1:80", "bootstrap_port": -1},
    {"type": "decode", "instance": "127.0.0.1:80", "bootstrap_port": False},
]
MALFORMED_BODIES = [b"", b"not json", b"[1, 2]", b"null", b'"decode"', b"\xff\xfe", b"{" * 5000]


async def test_malformed_admin_adds_are_4xx_never_500():
    async with admin_pair() as (proxy, _, _):
        for body in MALFORMED_ADDS:
            status, text = await admin_add(proxy, body)
            assert status == 400 and orjson.loads(text)["error"]["message"], (body, text)
        for raw in MALFORMED_BODIES:
            status, text = await admin_add(proxy, None, raw=raw)
            assert status == 400 and '"error"' in text, (raw[:20], text)
        status, _ = await admin_add(proxy, None, raw=b'{"a": "' + b"x" * 20_000 + b'"}')
        assert status == 413
        assert len(proxy.state.registry) == 2


def test_arabic_indic_port_refused_on_the_command_line():
    for argv in (["--prefill", "a:\u0668\u0660"], ["--prefill", "a:1", "\u0668\u0660"]):
        with pytest.raises(SystemExit):
            parse_config([*argv, "--decode", "d:1"], {})


@contextlib.asynccontextmanager
async def hostile_engine(models: bytes) -> AsyncIterator[str]:
    """An engine whose ``/v1/models`` answers ``models`` (200, as JSON)."""

    async def answer(_: web.Request) -> web.Response:
        return web.Response(body=models, content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/models", answer)

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await runner.cleanup()


WRONG_SHAPES = [b'{"data":"abc"}', b"[]", b"not json", b'{"data":[1,2]}', b'{"data":{"id":1}}']


@pytest.mark.parametrize("models", WRONG_SHAPES)
async def test_wrong_shaped_probe_answer_is_a_clear_refusal(models, caplog):
    caplog.set_level(logging.WARNING, logger="pdproxy")
    registry_port = free_port()
    config = ProxyConfig(
        model=MODEL,
        admin_api_key=KEY,
        registry=RegistryConfig(port=registry_port, host="127.0.0.1", ttl=0.6, sweep_interval=0.1),
    )
    async with (
        hostile_engine(models) as engine,
        running_proxy(config) as proxy,
        watched(proxy),
        dealer(f"tcp://127.0.0.1:{registry_port}") as sock,
    ):
        status, text = await admin_add(proxy, {"type": "decode", "instance": engine})
        assert status == 400 and '{\\"data\\": [{\\"id\\"' in text, text
        # the registration path's background probe: refused, never a crashed task
        message = {"type": "D", "http_address": engine, "zmq_address": "127.0.0.1:1"}
        for _ in range(5):
            await sock.send(msgpack.dumps(message))
            await asyncio.sleep(0.05)
        await until(lambda: any("/v1/models answer" in r.getMessage() for r in caplog.records))
        assert not proxy.state.registry.snapshot().decode
    assert not [r for r in caplog.records if r.exc_info or "never retrieved" in r.getMessage()]


async def test_aliases_are_one_instance():
    registry_port = free_port()
    async with (
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        running_sim(SimConfig(role="decode", model=MODEL)) as extra,
        running_proxy(
            ProxyConfig(
                prefill=(EngineAddress(url=p.url),),
                admin_api_key=KEY,
                registry=RegistryConfig(port=registry_port, host="127.0.0.1"),
            )
        ) as proxy,
        watched(proxy),
        dealer(f"tcp://127.0.0.1:{registry_port}") as sock,
    ):
        port = extra.port
        status, text = await admin_add(proxy, {"type": "decode", "instance": f"127.0.0.1:{port}"})
        assert status == 200, text
        for alias in (f"localhost:{port}", f"[::1]:{port}", f"127.1:{port}", f"LOCALHOST:{port}"):
            for role in ("prefill", "decode"):
                status, text = await admin_add(proxy, {"type": role, "instance": alias})
                # 127.1 is written 127.0.0.1: the same URL, the others another name of it
                assert status == 409 and ("another name" in text or "already" in text), text
        status, text = await admin_add(proxy, {"type": "prefill", "instance": f"0.0.0.0:{port}"})
        assert status == 400
        metrics = proxy.state.metrics
        for alias in (f"localhost:{port}", f"[::1]:{port}"):
            await sock.send(
                msgpack.dumps({"type": "P", "http_address": alias, "zmq_address": "h:1"})
            )
        await until(lambda: value(metrics.registry_messages, "refused") >= 2)
        assert sorted(e.url for e in proxy.state.registry.all()) == sorted([p.url, extra.url])
        # the admin API removes it by any of its names
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                proxy.url + "/instances/remove",
                json={"instance": f"localhost:{port}"},
                headers={"X-API-Key": KEY},
            ) as response,
        ):
            assert response.status == 200
        await until(lambda: proxy.state.registry.get(extra.url) is None)


async def test_workers_share_the_hop_and_the_owner_knows_its_own_address(tmp_path):
    """Under ``--workers`` the membership owner serves no HTTP: it refuses the listener's
    address all the same, and every worker refuses every worker's hop marker."""
    async with (
        workers_tree(tmp_path, register=True) as tree,
        dealer(f"tcp://127.0.0.1:{tree.registry_port}") as sock,
        aiohttp.ClientSession() as session,
    ):
        port = tree.url.rsplit(":", 1)[1]
        code, answer = await admin(
            session, tree.url, "add", {"type": "decode", "instance": f"localhost:{port}"}
        )
        assert code == 400 and "own listener" in answer["error"]["message"]
        for _ in range(3):
            msg = {"type": "D", "http_address": f"127.0.0.1:{port}", "zmq_address": "h:1"}
            await sock.send(msgpack.dumps(msg))
        await asyncio.sleep(0.5)
        routable = {i["url"] for i in (await status(session, tree.url))["instances"]}
        assert routable == {s.url for s in tree.prefills + tree.decodes}
        assert (await workers_complete(session, tree.url))[0] == 200
        via = tree.decodes[0].generation_requests()[0].headers["via"]
        assert via.startswith("1.1 pdproxy-")
        for _ in range(8):  # fresh connections: the kernel spreads them over the workers
            async with (
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s,
                s.post(tree.url + "/v1/completions", json=BODY, headers={"Via": via}) as r,
            ):
                assert r.status == 508
        assert len(tree.decodes[0].generation_requests()) == 1
