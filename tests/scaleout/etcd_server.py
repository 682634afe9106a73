"""A real etcd (Debian's etcd-server) on free loopback ports with a throwaway data dir, that
a test can stop and start again on the same ports and data (an outage, then a recovery)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

from engines.ports import free_port

_START_TIMEOUT = 20.0
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback only


class EtcdServer:
    def __init__(self, data_dir: Path) -> None:
        self.binary = shutil.which("etcd")
        self.data_dir = data_dir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.log_path = data_dir.parent / "etcd.log"
        self._process: asyncio.subprocess.Process | None = None

    @property
    def endpoint(self) -> tuple[str, int]:
        return ("127.0.0.1", self.client_port)

    def _command(self) -> list[str]:
        client = f"http://127.0.0.1:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"
        assert self.binary is not None
        return [
            self.binary,
            "--name=pdproxy-test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=pdproxy-test={peer}",
            "--initial-cluster-state=new",
            "--logger=zap",
            "--log-level=warn",
        ]

    async def start(self) -> None:
        assert self._process is None, "already running"
        with self.log_path.open("ab") as log:
            self._process = await asyncio.create_subprocess_exec(
                *self._command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            if self._process.returncode is not None:
                raise RuntimeError(f"etcd exited: {self.log_path.read_text()[-2000:]}")
            if await asyncio.to_thread(self._healthy):
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"etcd did not become healthy: {self.log_path.read_text()[-2000:]}")

    def _healthy(self) -> bool:
        url = f"http://127.0.0.1:{self.client_port}/health"
        try:
            with _DIRECT.open(url, timeout=1) as answer:
                return b'"true"' in answer.read()
        except OSError:
            return False

    async def stop(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), 10)
        except asyncio.TimeoutError:
            process.kill()
            await process.wait()
