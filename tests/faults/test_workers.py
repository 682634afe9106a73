"""Fault-matrix cases for ``--workers 2`` (real process trees): engine faults are survived by
every worker alike, and no fault of the process tree itself (a worker, both workers, the
supervisor killed) leaves a client or a process hanging."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time

import aiohttp
import orjson
import pytest

from tests.workers_harness import BODY, exit_code, pid_alive, workers_tree

pytestmark = pytest.mark.faults

BOUND = 15.0  # seconds any one client call may take in these cases


async def _call(url: str, **extra) -> str:
    """One request on a fresh connection (so the kernel spreads them), classified."""
    connector = aiohttp.TCPConnector(force_close=True)
    try:
        async with (
            aiohttp.ClientSession(connector=connector) as s,
            asyncio.timeout(BOUND),
            s.post(url + "/v1/completions", json={**BODY, **extra}) as r,
        ):
            raw = await r.read()
    except TimeoutError:
        return "hung"
    except aiohttp.ClientError:
        return "cut"  # the killed worker's own connections
    if r.status == 200:
        whole = raw.rstrip().endswith(b"[DONE]") if extra.get("stream") else orjson.loads(raw)
        return "ok" if whole else "truncated"
    error = orjson.loads(raw)["error"]  # OpenAI-shaped, whatever the status
    return f"{r.status} {error['type']}"


@pytest.mark.parametrize(
    "fault",
    [
        {"status": 503},
        {"refuse_connections": True},
        {"reset_after_bytes": 5},
        {"headers_delay_s": 30},
    ],
    ids=["5xx", "refused", "reset", "hung-headers"],
)
async def test_every_worker_survives_a_failing_decode(tmp_path, fault):
    extra = ("--decode-header-timeout-secs", "0.5", "--request-timeout-secs", "1")
    extra += ("--outlier-consecutive-failures", "2")
    async with workers_tree(tmp_path, n_decode=2, extra=extra) as tree:
        tree.decodes[0].set_faults(**fault)
        results = await asyncio.gather(*(_call(tree.url, stream=bool(i % 2)) for i in range(24)))
        assert results == ["ok"] * 24
        assert len(await tree.fresh_pids(20)) == 2


async def test_both_workers_killed_under_load_nothing_hangs_and_both_come_back(tmp_path):
    async with workers_tree(tmp_path, decode_tps=20) as tree:
        workers = tree.worker_pids()
        calls = [
            asyncio.create_task(_call(tree.url, stream=True, max_tokens=40)) for _ in range(12)
        ]
        await asyncio.sleep(0.5)
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        results = await asyncio.gather(*calls)
        assert "hung" not in results and set(results) <= {"ok", "cut"}
        deadline = time.monotonic() + BOUND
        while len(tree.worker_pids() - workers) < 2 or len(await _pids(tree)) < 2:
            assert time.monotonic() < deadline, "the workers were not replaced"
            await asyncio.sleep(0.2)
        assert await _call(tree.url) == "ok"


async def _pids(tree) -> set[int]:
    try:
        return await tree.fresh_pids(12)
    except aiohttp.ClientError:
        return set()


async def test_a_killed_supervisor_takes_its_workers_with_it(tmp_path):
    async with workers_tree(tmp_path) as tree:
        workers = tree.worker_pids()
        run_dir = _run_dir(next(iter(workers)))
        tree.proc.send_signal(signal.SIGKILL)
        assert await exit_code(tree.proc, 5) == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in workers):
            assert time.monotonic() < deadline, "orphaned workers kept running"
            await asyncio.sleep(0.1)
        # Nobody was left to remove the run directory: the test does.
        shutil.rmtree(run_dir, ignore_errors=True)


def _run_dir(pid: int) -> str:
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
    return os.path.dirname(env[b"PROMETHEUS_MULTIPROC_DIR"].decode())
