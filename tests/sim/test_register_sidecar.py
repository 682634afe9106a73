"""`python -m engines.register`: heartbeats only while the engine's /health answers 200."""

from __future__ import annotations

import asyncio
import signal
import sys

import msgpack

from engines.sim import SimConfig, running_sim
from tests.sim.test_registration import drain, recv, router


async def test_sidecar_follows_engine_health():
    async with router() as (sock, addr), running_sim(SimConfig(role="prefill")) as sim:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "engines.register",
            "--role",
            "prefill",
            "--engine",
            sim.url,
            "--proxy",
            addr,
            "--zmq-address",
            "127.0.0.1:14579",
            "--interval-s",
            "0.1",
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            _, msg = await recv(sock, 20)
            assert msg == {
                "type": "P",
                "http_address": f"127.0.0.1:{sim.port}",
                "zmq_address": "127.0.0.1:14579",
            }
            sim.set_faults(refuse_connections=True)  # engine down: pings stop
            await drain(sock, 0.3)
            assert await drain(sock, 0.5) == 0
            sim.clear_faults()  # back up: pings resume
            await recv(sock, 3)
            sim.set_faults(slow_start_s=30)  # /health 503: pings stop too
            await drain(sock, 0.3)
            assert await drain(sock, 0.5) == 0
            sim.clear_faults()
            await recv(sock, 3)
        finally:
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 10) == 0
        assert proc.stderr is not None
        log = (await proc.stderr.read()).decode()
    assert log.count("is unhealthy") == 2 and log.count("is healthy") == 3


async def test_sidecar_moriio_payload_when_sizes_given():
    async with router() as (sock, addr), running_sim(SimConfig(role="decode")) as sim:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "engines.register",
            "--role",
            "decode",
            "--engine",
            sim.url,
            "--proxy",
            addr,
            "--tp-size",
            "2",
            "--interval-s",
            "0.1",
        )
        try:
            _, msg = await recv(sock, 20)
        finally:
            proc.send_signal(signal.SIGINT)
            assert await asyncio.wait_for(proc.wait(), 10) == 0
    assert msg == {
        "type": "D",
        "http_address": f"127.0.0.1:{sim.port}",
        "zmq_address": "host:127.0.0.1,handshake:6301,notify:61005",
        "dp_size": 1,
        "tp_size": 2,
        "transfer_mode": "READ",
    }
    assert msgpack.packb(msg)
