from __future__ import annotations

import shutil
from collections.abc import AsyncIterator

import pytest

from tests.scaleout.etcd_server import EtcdServer


@pytest.fixture
async def etcd(tmp_path) -> AsyncIterator[EtcdServer]:
    """A real etcd server for one test; skips (saying why) where Debian's etcd-server is
    not installed (.ci/run installs it)."""
    if shutil.which("etcd") is None:
        pytest.skip("no etcd binary: apt-get install etcd-server (as .ci/run does)")
    pytest.importorskip("aetcd")
    server = EtcdServer(tmp_path / "etcd-data")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
