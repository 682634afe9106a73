"""Two (or three) pdproxy replicas, real uvicorn servers, sharing one registry through a
real etcd: an engine heartbeating (vLLM's msgpack payload over a real ZMQ DEALER) only to
replica A is routed by replica B; an admin removal on B drains it on A; stopping the
heartbeats expires it everywhere within the registry TTL; an etcd outage loses no routing
and the replicas converge again once it is back."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
import time
import uuid

import aiohttp
import msgpack
import zmq
import zmq.asyncio

from engines.ports import free_port
from engines.sim import SimConfig, running_sim
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.registry import RegistryConfig, SharedRegistryConfig
from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.scheduling.kv_keys import instance_name
from pdproxy.types import EndpointState, Role
from tests.integration.conftest import MODEL
from tests.scaleout.etcd_server import EtcdServer
from tests.servers import running_proxy

TTL, SWEEP, BEAT = 2.0, 0.1, 0.3  # etcd leases count whole seconds: 2 s is its floor
KEY = "scaleout-admin-key"


def _config(
    etcd: EtcdServer,
    prefix: str,
    zmq_port: int | None,
    scheduling: SchedulingConfig | None = None,
) -> ProxyConfig:
    registry = RegistryConfig(
        port=zmq_port,
        host="127.0.0.1",
        ttl=TTL,
        sweep_interval=SWEEP,
        shared=SharedRegistryConfig(etcd=(etcd.endpoint,), prefix=prefix),
    )
    return ProxyConfig(
        registry=registry, admin_api_key=KEY, scheduling=scheduling or SchedulingConfig()
    )


@contextlib.asynccontextmanager
async def replicas(etcd: EtcdServer, scheduling: SchedulingConfig | None = None):
    """Replica A (with the ZMQ registry engines heartbeat to) and replica B (none)."""
    prefix = f"/pdproxy/test-{uuid.uuid4().hex[:8]}/"
    zmq_port = free_port()
    async with (
        running_proxy(_config(etcd, prefix, zmq_port, scheduling)) as a,
        running_proxy(_config(etcd, prefix, None, scheduling)) as b,
    ):
        yield a, b, f"tcp://127.0.0.1:{zmq_port}", prefix


@contextlib.asynccontextmanager
async def heartbeats(endpoint: str, *sims):
    """vLLM's P2P-NCCL registration, from one DEALER per engine, every BEAT seconds."""
    ctx = zmq.asyncio.Context()
    socks = []
    for _ in sims:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        socks.append(sock)
    state = {"last": 0.0}

    async def beat():
        while True:
            for sock, (kind, sim) in zip(socks, sims, strict=True):
                payload = {
                    "type": kind,
                    "http_address": f"127.0.0.1:{sim.port}",
                    "zmq_address": f"127.0.0.1:{sim.kv_port}",
                }
                await sock.send(msgpack.dumps(payload))
            state["last"] = time.monotonic()
            await asyncio.sleep(BEAT)

    task = asyncio.create_task(beat())
    try:
        yield task, state
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for sock in socks:
            sock.close(0)
        ctx.term()


async def _until(predicate, timeout: float) -> float:
    """Seconds until ``predicate()`` held; fails after ``timeout``."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        await asyncio.sleep(0.01)
    raise AssertionError(f"condition not met within {timeout} s")


def _routable(proxy, url: str) -> bool:
    snap = proxy.state.registry.snapshot()
    return any(e.url == url for e in (*snap.prefill, *snap.decode))


async def _complete(s: aiohttp.ClientSession, proxy) -> int:
    body = {"model": MODEL, "prompt": "shared registry", "max_tokens": 2}
    async with s.post(proxy.url + "/v1/completions", json=body) as r:
        await r.read()
        return r.status


async def _admin(s: aiohttp.ClientSession, proxy, action: str, **body) -> int:
    headers = {"X-API-Key": KEY}
    async with s.post(f"{proxy.url}/instances/{action}", json=body, headers=headers) as r:
        await r.read()
        return r.status


async def _status(s: aiohttp.ClientSession, proxy) -> dict:
    async with s.get(proxy.url + "/status") as r:
        return (await r.json())["registry_backend"]


async def _until_up(s: aiohttp.ClientSession, proxy, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not (await _status(s, proxy))["up"]:
        assert time.monotonic() < deadline, "the replica did not (re)sync with etcd"
        await asyncio.sleep(0.05)


async def test_heartbeats_to_a_route_on_b_then_expire_everywhere(etcd):
    async with (
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        running_sim(SimConfig(role="decode", model=MODEL)) as d,
        replicas(etcd) as (a, b, zmq_endpoint, prefix),
        aiohttp.ClientSession() as s,
    ):
        assert (await _status(s, b))["up"] is True
        async with heartbeats(zmq_endpoint, ("P", p), ("D", d)) as (task, beats):
            first = time.monotonic()
            await _until(lambda: _routable(b, p.url) and _routable(b, d.url), timeout=1.0)
            assert time.monotonic() - first < 1.0
            assert b.state.registry.get(d.url).source.value == "registered"
            assert await _complete(s, b) == 200
            assert d.generation_requests() and p.generation_requests()

            # A replica started now resyncs from etcd before it serves.
            config = _config(etcd, prefix, None)
            async with running_proxy(config) as c:
                assert _routable(c, p.url) and _routable(c, d.url)
                assert await _complete(s, c) == 200

            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            last = beats["last"]
        gone = await _until(
            lambda: all(x.state.registry.get(u) is None for x in (a, b) for u in (p.url, d.url)),
            timeout=TTL + 2.0,
        )
        since_last_beat = time.monotonic() - last
        # A expires them one TTL after their last heartbeat (its sweep's granularity and
        # the watch's delivery on top), and B forgets them as A's claims go.
        assert since_last_beat <= TTL + 0.6, (since_last_beat, gone)
        assert (await _status(s, b))["learned_instances"] == 0


async def test_admin_removal_on_b_drains_on_a_and_stays_removed(etcd):
    async with (
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        running_sim(SimConfig(role="decode", model=MODEL)) as d,
        running_sim(SimConfig(role="decode", model=MODEL)) as d2,
        replicas(etcd) as (a, b, zmq_endpoint, _),
        aiohttp.ClientSession() as s,
        heartbeats(zmq_endpoint, ("P", p), ("D", d)),
    ):
        await _until(lambda: _routable(b, d.url) and _routable(a, d.url), timeout=2.0)
        assert await _admin(s, b, "remove", instance=f"127.0.0.1:{d.port}") == 200
        await _until(lambda: a.state.registry.get(d.url) is None, timeout=1.0)
        await asyncio.sleep(3 * BEAT)  # its heartbeats keep coming to A: still retired
        assert a.state.registry.get(d.url) is None and b.state.registry.get(d.url) is None

        # An admin addition on A reaches B, and B's admin removal of it drains it on A.
        assert await _admin(s, a, "add", type="decode", instance=f"127.0.0.1:{d2.port}") == 200
        await _until(lambda: _routable(b, d2.url), timeout=1.0)
        assert b.state.registry.get(d2.url).source.value == "admin"
        assert await _complete(s, b) == 200 and d2.generation_requests()
        assert await _admin(s, b, "remove", instance=f"127.0.0.1:{d2.port}") == 200
        await _until(lambda: a.state.registry.get(d2.url) is None, timeout=1.0)


async def test_an_instance_s_kv_events_endpoints_reach_every_replica(etcd, tmp_path):
    """An admin addition on A that says where the engine's KV events are: B's copy says
    it too, and B follows the same publisher (no template on either replica)."""
    events = f"ipc://{tmp_path}/{{port}}.events"
    kv = SchedulingConfig(decode_policy="kv-events")
    async with (
        running_sim(SimConfig(role="decode", model=MODEL, kv_events_endpoint=events)) as d,
        replicas(etcd, kv) as (a, b, _, _prefix),
        aiohttp.ClientSession() as s,
    ):
        own = events.replace("{port}", str(d.port))
        add = {"type": "decode", "instance": f"127.0.0.1:{d.port}", "kv_events_endpoint": own}
        assert await _admin(s, a, "add", **add) == 200
        await _until(lambda: b.state.registry.get(d.url) is not None, timeout=2.0)
        assert b.state.registry.get(d.url).address.kv_events_endpoint == own
        name = instance_name(d.url, 0)
        for proxy in (a, b):
            await _until(lambda p=proxy: name in p.state.kv_events.index.followed, timeout=3.0)
            assert proxy.state.kv_events.status()["instances"][name]["endpoint"] == own


async def test_etcd_outage_loses_no_routing_and_replicas_converge_after(etcd):
    async with (
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        running_sim(SimConfig(role="decode", model=MODEL)) as d,
        running_sim(SimConfig(role="decode", model=MODEL)) as d2,
        running_sim(SimConfig(role="decode", model=MODEL)) as d3,
        replicas(etcd) as (a, b, zmq_endpoint, _),
        aiohttp.ClientSession() as s,
        heartbeats(zmq_endpoint, ("P", p), ("D", d)),
    ):
        await _until(lambda: _routable(b, p.url) and _routable(b, d.url), timeout=2.0)
        await etcd.stop()
        outage_ends = time.monotonic() + 10.0
        statuses, saw_down = [], False
        while time.monotonic() < outage_ends:
            for proxy in (a, b):
                statuses.append(await _complete(s, proxy))
            if not saw_down:
                status = await _status(s, b)
                saw_down = status["up"] is False and status["last_error"]
                if saw_down:  # an admin change during the outage: applied locally at once
                    add = {"type": "decode", "instance": f"127.0.0.1:{d2.port}"}
                    assert await _admin(s, a, "add", **add) == 200
                    assert (await _status(s, a))["pending_writes"] == 1
            await asyncio.sleep(0.05)
        assert saw_down, "B never said etcd was unreachable"
        async with s.get(b.url + "/metrics") as r:
            assert "pdproxy_registry_backend_up 0.0" in await r.text()
        assert statuses and set(statuses) == {200}, statuses
        assert not _routable(b, d2.url)
        await etcd.start()

        await _until_up(s, a)
        await _until_up(s, b)
        # What A learned during the outage reaches B; a change after the restart reaches A.
        await _until(lambda: _routable(b, d2.url), timeout=1.0)
        assert await _admin(s, b, "add", type="decode", instance=f"127.0.0.1:{d3.port}") == 200
        await _until(lambda: _routable(a, d3.url), timeout=1.0)
        assert _routable(b, p.url) and _routable(b, d.url)
        assert await _complete(s, a) == 200 and await _complete(s, b) == 200
        assert (await _status(s, a))["pending_writes"] == 0


async def test_a_replica_that_never_reached_etcd_serves_and_catches_up(etcd):
    """etcd down when a replica starts: it starts anyway, says so, and learns the shared
    instances once etcd comes up."""
    async with (
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        running_sim(SimConfig(role="decode", model=MODEL)) as d,
        replicas(etcd) as (a, _b, zmq_endpoint, prefix),
        heartbeats(zmq_endpoint, ("P", p), ("D", d)),
        aiohttp.ClientSession() as s,
    ):
        await _until(lambda: _routable(a, d.url), timeout=2.0)
        await etcd.stop()
        config = _config(etcd, prefix, None)
        async with running_proxy(config) as c:
            status = await _status(s, c)
            assert status["up"] is False and status["backend"] == "etcd"
            assert c.state.registry.get(d.url) is None
            await etcd.start()
            await _until(lambda: _routable(c, d.url), timeout=10.0)
            endpoint = c.state.registry.get(d.url)
            assert endpoint.role is Role.DECODE and endpoint.state is EndpointState.READY


async def test_no_write_per_heartbeat_and_a_stopped_replica_hands_over_without_a_gap(etcd):
    """The steady state costs etcd no write (no echo between replicas, no write per
    heartbeat): the store's revision stays put. Replica A stops (a rolling update): its
    claims outlive it by its lease, the engines' heartbeats move to a new replica half a
    second later, and B routes to them throughout."""
    dead = ("127.0.0.1", free_port())  # nothing listens: the replicas move to the next member
    prefix = f"/pdproxy/test-{uuid.uuid4().hex[:8]}/"
    zmq_a, zmq_new = free_port(), free_port()
    config_b = _config(etcd, prefix, None)
    shared = SharedRegistryConfig(etcd=(dead, etcd.endpoint), prefix=prefix)
    config_b = dataclasses.replace(
        config_b, registry=dataclasses.replace(config_b.registry, shared=shared)
    )
    async with (
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        running_sim(SimConfig(role="decode", model=MODEL)) as d,
        running_proxy(config_b) as b,
        running_proxy(_config(etcd, prefix, zmq_new)) as new,
        aiohttp.ClientSession() as s,
    ):
        await _until_up(s, b)
        async with (
            running_proxy(_config(etcd, prefix, zmq_a)) as a,
            heartbeats(f"tcp://127.0.0.1:{zmq_a}", ("P", p), ("D", d)),
        ):
            await _until(lambda: _routable(b, p.url) and _routable(b, d.url), timeout=2.0)
            await asyncio.sleep(2 * BEAT)
            before = (await _status(s, a))["revision"]
            await asyncio.sleep(6 * BEAT)
            status = await _status(s, a)
            assert status["revision"] == before, "heartbeats or an echo kept writing"
            assert status["own_claims"] == 2 and (await _status(s, b))["learned_instances"] == 2
        gaps = []

        async def watch_b():
            while True:
                if not (_routable(b, p.url) and _routable(b, d.url)):
                    gaps.append(time.monotonic())
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch_b())
        try:
            await asyncio.sleep(0.5)  # the engines reconnect to another replica
            async with heartbeats(f"tcp://127.0.0.1:{zmq_new}", ("P", p), ("D", d)):
                await asyncio.sleep(TTL + 1.0)  # past the end of A's lease
                assert (await _status(s, new))["own_claims"] == 2
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
        assert not gaps, f"B lost the engines for {gaps[-1] - gaps[0]:.2f} s"
        assert await _complete(s, b) == 200


async def test_a_lost_lease_is_replaced_and_its_claims_written_again(etcd):
    """A's lease revoked behind its back (as when A stalled past its TTL): its claims
    vanish, B forgets them, and A notices, takes a new lease and writes them again."""
    import aetcd

    async with (
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        running_sim(SimConfig(role="decode", model=MODEL)) as d,
        replicas(etcd) as (a, b, zmq_endpoint, prefix),
        heartbeats(zmq_endpoint, ("P", p), ("D", d)),
        aetcd.Client(*etcd.endpoint, timeout=2) as client,
    ):
        await _until(lambda: _routable(b, p.url) and _routable(b, d.url), timeout=2.0)
        leases = {kv.lease for kv in await client.get_prefix(prefix.encode()) if kv.lease}
        assert len(leases) == 1  # one lease for all of A's heartbeat claims
        await client.revoke_lease(leases.pop())
        await _until(lambda: b.state.registry.get(d.url) is None, timeout=1.0)
        assert _routable(a, d.url)  # A's own routing never depended on etcd
        await _until(lambda: _routable(b, p.url) and _routable(b, d.url), timeout=3.0)
        leases = {kv.lease for kv in await client.get_prefix(prefix.encode()) if kv.lease}
        assert len(leases) == 1


async def test_a_killed_replica_s_claims_expire_with_its_lease(etcd, tmp_path):
    """Replica A as a real process (the CLI, uvloop), killed with SIGKILL: nothing revokes
    its lease, so its heartbeat claims go when the lease runs out, one TTL later."""
    http_port, zmq_port = free_port(), free_port()
    host, port = etcd.endpoint
    log = (tmp_path / "replica-a.log").open("wb")
    prefix = f"/pdproxy/test-{uuid.uuid4().hex[:8]}/"
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "pdproxy",
        *("--host", "127.0.0.1", "--port", str(http_port)),
        *("--registry-host", "127.0.0.1", "--registry-port", str(zmq_port)),
        *("--registry-ttl", str(TTL), "--registry-backend", f"etcd://{host}:{port}"),
        *("--etcd-prefix", prefix),
        stdout=log,
        stderr=asyncio.subprocess.STDOUT,
        stdin=asyncio.subprocess.DEVNULL,
    )
    try:
        async with (
            running_sim(SimConfig(role="prefill", model=MODEL)) as p,
            running_sim(SimConfig(role="decode", model=MODEL)) as d,
            running_proxy(_config(etcd, prefix, None)) as b,
            heartbeats(f"tcp://127.0.0.1:{zmq_port}", ("P", p), ("D", d)),
            aiohttp.ClientSession() as s,
        ):
            await _until(lambda: _routable(b, p.url) and _routable(b, d.url), timeout=15.0)
            assert await _complete(s, b) == 200
            process.kill()
            await process.wait()
            killed = time.monotonic()
            await _until(lambda: b.state.registry.get(d.url) is None, timeout=TTL + 2.0)
            # The lease's TTL from A's last keep-alive (a third of it before the kill at
            # most), plus etcd's expiry check (every 0.5 s); never before it could run out.
            assert TTL * 2 / 3 - 0.2 <= time.monotonic() - killed <= TTL + 1.0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        log.close()
