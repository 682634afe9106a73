"""The two ways out composed: replica A is a real ``pdproxy --workers 2 --registry-backend
etcd://`` process tree, replica B a single process on the same real etcd. An engine that
heartbeats only to B is routed by both of A's workers within a second; an admin removal
through one of A's workers drains it on B; A's workers show the shared registry's status as
A's supervisor (the membership owner) sees it, through an etcd outage that costs A no
request; and only the supervisor ever connects to etcd."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from engines.ports import free_port
from engines.sim import SimConfig, running_sim
from tests.metrics_contract import load_contract, parse_exposition
from tests.scaleout.etcd_server import EtcdServer
from tests.scaleout.test_etcd_replicas import BEAT, _config, heartbeats
from tests.servers import running_proxy
from tests.workers_harness import MODEL, Tree, admin, complete, status, workers_tree

ROUTED_WITHIN = 1.0  # seconds from the first heartbeat to B until both of A's workers route
OUTAGE_NOTICED = 10.0  # etcd stopped: A's workers say so (the owner's RPC timeout + 1 s)
RECOVERED = 20.0  # etcd back: the owner's session backoff (at most 5 s) and a full read


def _etcd_sockets(pid: int, port: int) -> int:
    """TCP sockets of process ``pid`` whose remote end is ``port`` on loopback (from its
    fds and the network namespace's tables, as ``ss -p`` finds them)."""
    inodes = set()
    with contextlib.suppress(FileNotFoundError):  # a process that has just exited
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[len("socket:[") : -1])
    found = 0
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                remote_port = int(fields[2].rsplit(":", 1)[1], 16)
                if remote_port == port and fields[9] in inodes:
                    found += 1
    return found


def _only_the_owner_connects(tree: Tree, etcd: EtcdServer) -> None:
    workers = tree.worker_pids()
    assert len(workers) == 2
    assert _etcd_sockets(tree.proc.pid, etcd.client_port) >= 1, "the owner is not on etcd"
    for pid in workers:
        assert _etcd_sockets(pid, etcd.client_port) == 0, f"worker {pid} connects to etcd"


Pinned = list[tuple[aiohttp.ClientSession, int]]  # a keep-alive session on each worker


async def _each_worker(
    tree: Tree,
    pinned: Pinned,
    check: Callable[[dict[str, Any]], bool],
    timeout: float,
    between: Callable[[], Awaitable[None]] | None = None,
) -> float:
    """Seconds until ``check`` holds for the /status of every pinned worker (``between``
    runs after each round where it does not)."""
    start = time.monotonic()
    while True:
        bodies = await asyncio.gather(*(status(s, tree.url) for s, _ in pinned))
        if all(check(b) for b in bodies):
            return time.monotonic() - start
        elapsed = time.monotonic() - start
        assert elapsed < timeout, f"not on every worker within {timeout} s: {bodies}"
        if between is not None:
            await between()
        await asyncio.sleep(0.01)


def _routable(body: dict[str, Any], *urls: str) -> bool:
    routable = {i["url"] for i in body["instances"] if i["routable"]}
    return set(urls) <= routable


def _backend(up: bool, etcd: EtcdServer, prefix: str) -> Callable[[dict[str, Any]], bool]:
    host, port = etcd.endpoint

    def check(body: dict[str, Any]) -> bool:
        backend = body["registry_backend"]
        assert backend["backend"] == "etcd", backend
        assert backend["endpoints"] == [f"{host}:{port}"] and backend["prefix"] == prefix
        return bool(backend["up"] is up)

    return check


async def _served_by_both(tree: Tree, pids: set[int], requests: int = 200) -> list[int]:
    """Completions over fresh connections until both workers have served one; their codes."""
    codes, seen = [], set()
    for _ in range(requests):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as s:
            seen.add((await status(s, tree.url))["worker"]["pid"])  # then the same connection
            codes.append((await complete(s, tree.url))[0])
        if seen == pids:
            return codes
    raise AssertionError(f"only {seen} of {pids} answered {requests} connections")


async def test_a_workers_tree_and_a_replica_share_one_etcd(etcd, tmp_path):
    prefix = f"/pdproxy/test-{uuid.uuid4().hex[:8]}/"
    host, port = etcd.endpoint
    backend = ("--registry-backend", f"etcd://{host}:{port}", "--etcd-prefix", prefix)
    zmq_b = free_port()
    async with (
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        running_sim(SimConfig(role="decode", model=MODEL)) as d,
        running_sim(SimConfig(role="decode", model=MODEL)) as d2,
        running_proxy(_config(etcd, prefix, zmq_b)) as b,
        workers_tree(
            tmp_path, register=True, n_prefill=0, n_decode=0, extra=backend, ready="/health"
        ) as tree,
    ):
        pinned = list(await tree.one_of_each())
        pids = {pid for _, pid in pinned}
        await _each_worker(tree, pinned, _backend(True, etcd, prefix), timeout=10.0)
        _only_the_owner_connects(tree, etcd)
        async with heartbeats(f"tcp://127.0.0.1:{zmq_b}", ("P", p), ("D", d), ("D", d2)):
            took = await _each_worker(
                tree, pinned, lambda body: _routable(body, p.url, d.url, d2.url), timeout=10.0
            )
            assert took < ROUTED_WITHIN, f"routable on both of A's workers after {took:.2f} s"
            codes = await _served_by_both(tree, pids)
            assert set(codes) == {200}, codes
            decoded = len(d.generation_requests()) + len(d2.generation_requests())
            assert len(p.generation_requests()) == decoded == len(codes)
            await _removal_through_a_drains_on_b(tree, pinned, b, d2)
            await _outage(tree, pinned, etcd, prefix, pids)
            _only_the_owner_connects(tree, etcd)  # the owner's new session, none of theirs


async def _removal_through_a_drains_on_b(tree: Tree, pinned: Pinned, b: Any, d2: Any) -> None:
    (first, _), (second, _) = pinned
    code, answer = await admin(first, tree.url, "remove", {"instance": f"127.0.0.1:{d2.port}"})
    assert code == 200 and answer["status"] == "draining", answer
    deadline = time.monotonic() + 2.0
    while b.state.registry.get(d2.url) is not None:
        assert time.monotonic() < deadline, "B still has the instance A's worker removed"
        await asyncio.sleep(0.01)
    gone = await _each_worker(tree, pinned, lambda body: not _routable(body, d2.url), 1.0)
    assert gone < 1.0
    await asyncio.sleep(3 * BEAT)  # its heartbeats keep coming to B: it stays retired
    assert b.state.registry.get(d2.url) is None
    assert not _routable(await status(second, tree.url), d2.url)


async def _outage(
    tree: Tree,
    pinned: Pinned,
    etcd: EtcdServer,
    prefix: str,
    pids: set[int],
) -> None:
    """etcd stopped: A's workers say so (status and metrics) and keep serving; back: up."""
    codes: list[int] = []

    async def serve() -> None:
        for session, _ in pinned:  # one request through each worker per round
            codes.append((await complete(session, tree.url))[0])

    await etcd.stop()
    took = await _each_worker(tree, pinned, _backend(False, etcd, prefix), OUTAGE_NOTICED, serve)
    for session, _ in pinned:
        body = (await status(session, tree.url))["registry_backend"]
        assert body["last_error"], body
        await _until_backend_up(tree, session, 0)
        async with session.get(tree.url + "/metrics") as r:
            _holds_the_contract(await r.text())
    codes += await _served_by_both(tree, pids)
    assert codes and set(codes) == {200}, (took, codes)
    await etcd.start()
    await _each_worker(tree, pinned, _backend(True, etcd, prefix), RECOVERED, serve)
    for session, _ in pinned:
        await _until_backend_up(tree, session, 1)
    assert set(codes) == {200}, codes


async def _until_backend_up(tree: Tree, session: aiohttp.ClientSession, value: float) -> None:
    """Until ``pdproxy_registry_backend_up`` on this worker's /metrics (one series, no pid
    label: the live processes' minimum) is ``value``; each worker writes its copy of the
    owner's figure every quarter second, so it may lag /status by that much."""
    deadline = time.monotonic() + 2.0
    while True:
        async with session.get(tree.url + "/metrics") as r:
            text = await r.text()
        lines = [x for x in text.splitlines() if x.startswith("pdproxy_registry_backend_up")]
        assert len(lines) == 1 and lines[0].startswith("pdproxy_registry_backend_up "), lines
        if float(lines[0].split()[1]) == value:
            return
        assert time.monotonic() < deadline, lines
        await asyncio.sleep(0.05)


def _holds_the_contract(text: str) -> None:
    """Every family of the committed contract, with its labels (no per-process ``pid``)."""
    contract = load_contract()
    types, samples = parse_exposition(text)
    assert {n for n in types if n.startswith("pdproxy_")} == set(contract)
    for name, family in contract.items():
        for labels in samples.get(name, ()):
            assert labels == family.labels, (name, sorted(labels))
    assert samples["pdproxy_registry_backend_sync_age_seconds"] == {frozenset()}
