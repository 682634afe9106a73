from __future__ import annotations

import shutil
from collections.abc import AsyncIterator

import pytest

from tests.scaleout.etcd_server import EtcdServer


@pytest.fixture
async def etcd(tmp_path) -> AsyncIterator[EtcdServer]:
    """A real etcd server for one test; skips (saying why) where Debian's etcd-server is
    not installed (make test installs it: tests/install-tools.sh)."""
    if shutil.which("etcd") is None:
        pytest.skip(
            "no etcd binary: apt-get install etcd-server (make test does: tests/install-tools.sh)"
        )
    pytest.importorskip("aetcd")
    server = EtcdServer(tmp_path / "etcd-data")
    await server.start()
    try:
        yield server
    finally:
        await server.stop()
