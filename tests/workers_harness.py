"""A real ``pdproxy --workers N`` process tree in front of sims, and clients that can tell
which worker answered (the ``worker`` field of ``/status``)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.procs import process
from engines.ports import free_port
from engines.sim import SimConfig, SimHandle, running_sim

MODEL = "sim-model"
ADMIN_KEY = "workers-admin-key"
BODY = {"model": MODEL, "prompt": "hello workers", "max_tokens": 4}


@dataclass
class Tree:
    url: str
    proc: Any  # the supervisor's Popen
    prefills: list[SimHandle]
    decodes: list[SimHandle]
    registry_port: int | None
    log: Path
    sessions: list[aiohttp.ClientSession] = field(default_factory=list)

    async def pinned(
        self, exclude: frozenset[int] | set[int] = frozenset()
    ) -> tuple[aiohttp.ClientSession, int]:
        """A session on one keep-alive connection, to a worker whose pid is not excluded."""
        for _ in range(200):
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
            pid = (await status(session, self.url))["worker"]["pid"]
            if pid not in exclude:
                self.sessions.append(session)
                return session, pid
            await session.close()
        raise AssertionError(f"no worker other than {exclude} answered")

    async def one_of_each(self) -> tuple[tuple[aiohttp.ClientSession, int], ...]:
        a = await self.pinned()
        b = await self.pinned({a[1]})
        return a, b

    async def fresh_pids(self, connections: int) -> set[int]:
        """The pids that answered ``connections`` new connections."""
        pids = set()
        for _ in range(connections):
            async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(force_close=True)
            ) as session:
                pids.add((await status(session, self.url))["worker"]["pid"])
        return pids

    def worker_pids(self) -> set[int]:
        """The supervisor's live children (from /proc)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        with contextlib.suppress(OSError):
            return {int(p) for p in children.read_text().split()}
        return set()


async def status(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url + "/status") as r:
        assert r.status == 200
        body: dict[str, Any] = orjson.loads(await r.read())
        return body


async def complete(
    session: aiohttp.ClientSession,
    url: str,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> tuple[int, bytes]:
    async with session.post(url + "/v1/completions", json={**BODY, **extra}, headers=headers) as r:
        return r.status, await r.read()


async def admin(
    session: aiohttp.ClientSession, url: str, op: str, body: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    headers = {"X-API-Key": ADMIN_KEY}
    async with session.post(f"{url}/instances/{op}", json=body, headers=headers) as r:
        return r.status, orjson.loads(await r.read())


async def exit_code(proc: Any, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        assert time.monotonic() < deadline, "the process did not exit in time"
        await asyncio.sleep(0.05)
    return int(proc.returncode)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.asynccontextmanager
async def workers_tree(
    tmp_path: Path,
    *,
    workers: int = 2,
    n_prefill: int = 1,
    n_decode: int = 1,
    register: bool = False,
    decode_tps: float = 0.0,
    extra: tuple[str, ...] = (),
    ready: str = "/ready",
) -> AsyncIterator[Tree]:
    """Sims on this loop, ``pdproxy --workers N`` as a process tree on a free port, awaited
    until ``ready`` answers 200 and every worker has started (``/health`` for a tree with
    no instance yet, which is not ready)."""
    registry_port = free_port() if register else None
    sim: dict[str, Any] = dict(connector="nixl", model=MODEL, strict=True)
    if registry_port is not None:
        sim.update(register=f"tcp://127.0.0.1:{registry_port}", register_interval_s=0.2)
    async with contextlib.AsyncExitStack() as stack:
        prefills = [
            await stack.enter_async_context(running_sim(SimConfig(role="prefill", **sim)))
            for _ in range(n_prefill)
        ]
        decodes = [
            await stack.enter_async_context(
                running_sim(SimConfig(role="decode", decode_tps=decode_tps, **sim))
            )
            for _ in range(n_decode)
        ]
        port = free_port()
        args = [sys.executable, "-m", "pdproxy", "--host", "127.0.0.1", "--port", str(port)]
        args += ["--workers", str(workers), "--decode-policy", "round-robin"]
        args += ["--health-check-interval-secs", "0.5", "--shutdown-timeout-secs", "10"]
        if registry_port is None:
            args += ["--prefill", *(p.url for p in prefills), "--decode", *(d.url for d in decodes)]
        else:
            args += ["--registry-port", str(registry_port), "--registry-host", "127.0.0.1"]
            args += ["--registry-ttl", "2"]
        key_file = tmp_path / "admin-key"
        key_file.write_text(ADMIN_KEY)
        args += ["--admin-api-key-file", str(key_file), *extra]
        log = tmp_path / "pdproxy.log"
        proc = stack.enter_context(process(args, str(log)))
        tree = Tree(f"http://127.0.0.1:{port}", proc, prefills, decodes, registry_port, log)
        try:
            await _until_ready(tree, workers, ready)
            yield tree
        finally:
            for session in tree.sessions:
                await session.close()


async def _until_ready(tree: Tree, workers: int, ready: str) -> None:
    deadline = time.monotonic() + 30
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            assert tree.proc.poll() is None, tree.log.read_text()[-3000:]
            with contextlib.suppress(aiohttp.ClientError):
                async with s.get(tree.url + ready) as r:
                    if r.status == 200 and len(tree.worker_pids()) == workers:
                        await _until_all_started(tree)
                        return
            await asyncio.sleep(0.05)
    raise AssertionError("pdproxy --workers did not become ready:\n" + tree.log.read_text()[-3000:])


async def _until_all_started(tree: Tree) -> None:
    """Every worker logged its start-up complete (so the kernel spreads over all of them)."""
    deadline = time.monotonic() + 30
    while tree.log.read_text().count("Application startup complete") < len(tree.worker_pids()):
        assert time.monotonic() < deadline, "the workers did not all start"
        await asyncio.sleep(0.05)
