"""Each fault knob, settable at start, through the handle and through /sim/faults."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest

from engines.sim import Faults, SimConfig, running_sim
from tests.sim.helpers import CHAT, COMPLETIONS, body_for, post, sse_events, wait_for


async def test_status_fault(session):
    async with running_sim(SimConfig()) as sim:
        sim.set_faults(status=503)
        status, raw = await post(session, sim.url + COMPLETIONS, body_for(COMPLETIONS))
        assert status == 503
        assert orjson.loads(raw)["error"]["code"] == 503
        assert sim.generation_requests()[-1].outcome == "error"
        sim.clear_faults()
        status, _ = await post(session, sim.url + COMPLETIONS, body_for(COMPLETIONS))
        assert status == 200


async def test_faults_over_http(session):
    async with running_sim(SimConfig()) as sim:
        async with session.post(sim.url + "/sim/faults", json={"status": 500}) as resp:
            assert resp.status == 200
        assert sim.faults.status == 500
        status, _ = await post(session, sim.url + CHAT, body_for(CHAT))
        assert status == 500
        async with session.post(sim.url + "/sim/faults", json={"bogus": 1}) as resp:
            assert resp.status == 400
        async with session.delete(sim.url + "/sim/faults") as resp:
            assert resp.status == 200
        assert sim.faults == Faults()
        status, _ = await post(session, sim.url + CHAT, body_for(CHAT))
        assert status == 200


async def test_status_fault_at_start(session):
    async with running_sim(SimConfig(faults=Faults(status=429))) as sim:
        status, _ = await post(session, sim.url + COMPLETIONS, body_for(COMPLETIONS))
    assert status == 429


async def test_hang_fault_and_disconnect_is_recorded(session):
    async with running_sim(SimConfig(faults=Faults(hang=True))) as sim:
        task = asyncio.create_task(post(session, sim.url + COMPLETIONS, body_for(COMPLETIONS)))
        await wait_for(sim.generation_requests)
        await asyncio.sleep(0.2)
        assert not task.done() and sim.generation_requests()[0].outcome == "pending"
        task.cancel()
        closed_at = time.time()
        await asyncio.gather(task, return_exceptions=True)
        record = sim.generation_requests()[0]
        await wait_for(lambda: record.outcome == "client_disconnected")
        assert record.disconnected_at is not None and record.disconnected_at - closed_at < 0.05
        assert sim.counters.client_disconnects == 1


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("decode_tps", [0, 200])
async def test_close_after_tokens_streaming(session, path, decode_tps):
    async with running_sim(SimConfig(decode_tps=decode_tps)) as sim:
        sim.set_faults(close_after_tokens=3)
        raw = b""
        with pytest.raises(aiohttp.ClientPayloadError):
            async with session.post(sim.url + path, json=body_for(path, 8, stream=True)) as resp:
                assert resp.status == 200
                async for chunk in resp.content.iter_any():
                    raw += chunk
        events = [orjson.loads(e) for e in sse_events(raw)]
        tokens = [
            e
            for e in events
            if e["choices"]
            and (e["choices"][0].get("text") or e["choices"][0].get("delta", {}).get("content"))
        ]
        assert len(tokens) == 3
        assert sim.generation_requests()[0].outcome == "error"


@pytest.mark.parametrize("decode_tps", [0, 200])
async def test_close_after_tokens_non_streaming(session, decode_tps):
    async with running_sim(SimConfig(decode_tps=decode_tps)) as sim:
        sim.set_faults(close_after_tokens=0)
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await post(session, sim.url + COMPLETIONS, body_for(COMPLETIONS))
        sim.clear_faults()
        status, _ = await post(session, sim.url + COMPLETIONS, body_for(COMPLETIONS))
        assert status == 200


async def _connects(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as s, s.get(url + "/health") as resp:
            return resp.status == 200
    except aiohttp.ClientConnectorError:
        return False


async def test_refuse_connections(session):
    async with running_sim(SimConfig()) as sim:
        sim.set_faults(refuse_connections=True)
        assert not await _connects(sim.url)
        sim.clear_faults()
        deadline = time.monotonic() + 2
        while not await _connects(sim.url):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)


async def test_refuse_connections_for_a_while(session):
    async with running_sim(SimConfig(faults=Faults(refuse_connections=0.2))) as sim:
        assert not await _connects(sim.url)
        await asyncio.sleep(0.3)
        assert await _connects(sim.url)
        assert sim.faults == Faults()


async def test_keep_alive_connection_survives_refuse(session):
    async with running_sim(SimConfig()) as sim:
        assert (await post(session, sim.url + COMPLETIONS, body_for(COMPLETIONS)))[0] == 200
        async with session.post(sim.url + "/sim/faults", json={"refuse_connections": True}):
            pass
        assert not await _connects(sim.url)
        async with session.delete(sim.url + "/sim/faults") as resp:  # pooled connection
            assert resp.status == 200
        await asyncio.sleep(0.05)
        assert await _connects(sim.url)


async def test_slow_start(session):
    async with running_sim(SimConfig(faults=Faults(slow_start_s=0.3))) as sim:
        async with session.get(sim.url + "/health") as resp:
            assert resp.status == 503
        await asyncio.sleep(0.35)
        async with session.get(sim.url + "/health") as resp:
            assert resp.status == 200
        sim.set_faults(slow_start_s=10)
        async with session.get(sim.url + "/health") as resp:
            assert resp.status == 503
