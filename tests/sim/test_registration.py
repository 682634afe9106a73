"""Self-registration: a real zmq ROUTER receives the exact payloads vLLM engines send."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import msgpack
import pytest
import zmq
import zmq.asyncio

from engines.sim import SimConfig, running_sim
from engines.sim.registration import Registrant, build_payload

INTERVAL = 0.05


@contextlib.asynccontextmanager
async def router() -> AsyncIterator[tuple[zmq.asyncio.Socket, str]]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        yield sock, f"tcp://127.0.0.1:{port}"
    finally:
        sock.close(linger=0)
        ctx.term()


async def recv(sock: zmq.asyncio.Socket, timeout: float = 3.0) -> tuple[bytes, dict]:
    identity, payload = await asyncio.wait_for(sock.recv_multipart(), timeout)
    return identity, msgpack.unpackb(payload)


async def drain(sock: zmq.asyncio.Socket, quiet_s: float, limit_s: float = 3.0) -> int:
    """Read messages until none arrives for quiet_s (at most limit_s); return how many."""
    n = 0
    deadline = asyncio.get_running_loop().time() + limit_s
    while asyncio.get_running_loop().time() < deadline:
        try:
            await asyncio.wait_for(sock.recv_multipart(), quiet_s)
        except asyncio.TimeoutError:
            return n
        n += 1
    return n


async def test_p2p_payload_and_identity():
    async with router() as (sock, addr):
        cfg = SimConfig(
            role="prefill", connector="p2p-nccl", register=addr, register_interval_s=INTERVAL
        )
        async with running_sim(cfg) as sim:
            identity, msg = await recv(sock)
            _, again = await recv(sock)
    assert (
        msg
        == again
        == {
            "type": "P",
            "http_address": f"127.0.0.1:{sim.port}",
            "zmq_address": f"127.0.0.1:{sim.kv_port}",
        }
    )
    assert identity == sim.zmq_address.encode()  # P2P-NCCL sets IDENTITY to its zmq_address


async def test_moriio_payload():
    async with router() as (sock, addr):
        cfg = SimConfig(
            role="decode",
            connector="moriio",
            transfer_mode="WRITE",
            dp_size=2,
            tp_size=4,
            register=addr,
            register_format="moriio",
            register_interval_s=INTERVAL,
        )
        async with running_sim(cfg) as sim:
            _, msg = await recv(sock)
    port = sim.kv_port
    assert msg == {
        "type": "D",
        "http_address": f"127.0.0.1:{sim.port}",
        "zmq_address": f"host:127.0.0.1,handshake:{port},notify:{port}",
        "dp_size": 2,
        "tp_size": 4,
        "transfer_mode": "WRITE",
    }


async def test_moriio_legacy_payload():
    async with router() as (sock, addr):
        cfg = SimConfig(
            role="prefill",
            connector="moriio",
            register=addr,
            register_format="moriio-legacy",
            register_interval_s=INTERVAL,
        )
        async with running_sim(cfg) as sim:
            _, msg = await recv(sock)
            assert sim.registration_payload() == msg
    assert msg == {
        "type": "register",
        "role": "P",
        "request_address": f"http://127.0.0.1:{sim.port}/v1/completions",
        "handshake_port": sim.kv_port,
        "notify_port": sim.kv_port,
        "dp_size": 1,
        "tp_size": 1,
        "transfer_mode": "READ",
    }


async def test_zmq_address_override():
    async with router() as (sock, addr):
        cfg = SimConfig(
            role="decode", register=addr, register_interval_s=INTERVAL, zmq_address="10.9.8.7:4242"
        )
        async with running_sim(cfg) as sim:
            _, msg = await recv(sock)
    assert msg["zmq_address"] == sim.zmq_address == "10.9.8.7:4242"


async def test_pause_resume_and_stop_end_heartbeats():
    async with router() as (sock, addr):
        cfg = SimConfig(role="decode", register=addr, register_interval_s=INTERVAL)
        async with running_sim(cfg) as sim:
            await recv(sock)
            sim.pause_registration()
            await drain(sock, 0.15)
            assert await drain(sock, 0.3) == 0
            sim.resume_registration()
            await recv(sock, 1.0)
            assert sim.heartbeat is not None and sim.heartbeat.sent >= 2
        await drain(sock, 0.1)
        assert await drain(sock, 0.3) == 0  # stopped with the sim
    assert sim.heartbeat is not None and sim.heartbeat._task is None


async def test_kill_ends_heartbeats_and_restart_resumes_them_with_the_same_identity():
    async with router() as (sock, addr):
        cfg = SimConfig(
            role="decode", connector="p2p-nccl", register=addr, register_interval_s=INTERVAL
        )
        async with running_sim(cfg) as sim:
            identity, msg = await recv(sock)
            await sim.kill()
            await drain(sock, 0.1)
            assert await drain(sock, 0.2) == 0
            await sim.restart()
            assert await recv(sock, 1.0) == (identity, msg)  # same ports, same registration


async def test_role_both_does_not_register():
    async with (
        router() as (sock, addr),
        running_sim(SimConfig(register=addr, register_interval_s=INTERVAL)) as sim,
    ):
        assert sim.heartbeat is None
        assert await drain(sock, 0.3) == 0


def test_build_payload_rejects_unknown_format():
    with pytest.raises(ValueError, match="unknown registration format"):
        build_payload("bogus", Registrant("P", "1.2.3.4:5", "1.2.3.4:6"))
    with pytest.raises(ValueError, match="lacks"):
        build_payload("moriio-legacy", Registrant("P", "1.2.3.4:5", "1.2.3.4:6"))
