"""Start the benchmark's servers as separate processes and read their CPU time from /proc."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import aiohttp

from engines.procs import process as child_process

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (not its children)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and of its descendants alive now (every thread
    of each: a router that spreads over threads, or a pdproxy whose workers are processes)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                children.setdefault(_parent(int(entry.name)), []).append(int(entry.name))
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        with contextlib.suppress(OSError):
            total += cpu_seconds(current)
        todo.extend(children.get(current, ()))
    return total


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@contextlib.contextmanager
def process(args: list[str], log_path: str) -> Iterator[subprocess.Popen[bytes]]:
    with open(log_path, "wb") as log, child_process(args, log) as proc:
        yield proc


async def wait_healthy(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.get(url + "/health") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not become healthy in {timeout} s")


def sim_args(port: int, role: str, decode_tps: float) -> list[str]:
    return [
        sys.executable,
        "-m",
        "engines.sim",
        "--port",
        str(port),
        "--role",
        role,
        "--connector",
        "nixl",
        "--decode-tps",
        str(decode_tps),
        "--log-level",
        "warning",
    ]


def proxy_args(port: int, prefill: str, decode: str, *extra: str) -> list[str]:
    """pdproxy on its default flags (logs at info with the access line, health checks, the
    engines' metrics scrape, the default policy) plus ``extra``."""
    return [
        sys.executable,
        "-m",
        "pdproxy",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--prefill",
        prefill,
        "--decode",
        decode,
        *extra,
    ]
