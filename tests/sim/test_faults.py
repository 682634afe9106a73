"""Each fault knob, settable at start, through the handle and through /sim/faults."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest

from engines.sim import Faults, SimConfig, running_sim
from tests.sim.helpers import (
    CHAT,
    COMPLETIONS,
    body_for,
    post,
    prefill,
    sse_events,
    text_of,
    wait_for,
)


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


def _tokens(raw: bytes) -> list[dict]:
    """Token chunks among the complete SSE events of a (possibly cut) stream."""
    events = [e[len(b"data: ") :] for e in raw.split(b"\n\n")[:-1] if e.startswith(b"data: ")]
    chunks = [orjson.loads(e) for e in events if e != b"[DONE]"]
    return [
        c
        for c in chunks
        if c["choices"]
        and (c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content"))
    ]


async def _read_partial(session, url: str, body: dict, raw: bytearray) -> int:
    """POST and collect the body into `raw` as it arrives; returns the status."""
    async with session.post(url, json=body) as resp:
        async for chunk in resp.content.iter_any():
            raw.extend(chunk)
        return resp.status


@pytest.mark.parametrize("stream", [False, True])
async def test_headers_delay(session, stream):
    async with running_sim(SimConfig(faults=Faults(headers_delay_s=0.2))) as sim:
        started = time.monotonic()
        async with session.post(sim.url + CHAT, json=body_for(CHAT, stream=stream)) as resp:
            waited = time.monotonic() - started
            raw = await resp.read()
        assert resp.status == 200 and waited >= 0.2
        assert len(text_of(raw, stream).split()) == 8
        assert sim.generation_requests()[0].outcome == "completed"


async def test_headers_delay_disconnect_aborts_the_request(session):
    async with running_sim(SimConfig(faults=Faults(headers_delay_s=0.2))) as sim:
        task = asyncio.create_task(post(session, sim.url + COMPLETIONS, body_for(COMPLETIONS)))
        await wait_for(sim.generation_requests)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        record = sim.generation_requests()[0]
        await wait_for(lambda: record.outcome == "client_disconnected")
        await asyncio.sleep(0.25)  # past the delay: nothing was generated after all
        assert record.outcome == "client_disconnected" and sim.counters.client_disconnects == 1
        assert sim.counters.prompt_tokens == 0 and sim.counters.generation_tokens == 0


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("decode_tps", [0, 1000])
async def test_reset_after_bytes(session, stream, decode_tps):
    async with running_sim(SimConfig(decode_tps=decode_tps)) as sim:
        sim.set_faults(reset_after_bytes=20)
        raw = bytearray()
        body = body_for(COMPLETIONS, stream=stream)
        with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError)):
            async with session.post(sim.url + COMPLETIONS, json=body) as resp:
                assert resp.status == 200
                async for chunk in resp.content.iter_any():
                    raw.extend(chunk)
        assert len(raw) == 20 and raw.startswith(b'data: {"id":"cmpl-' if stream else b'{"id":"')
        record = sim.generation_requests()[0]
        assert (record.outcome, record.status, record.error) == (
            "error",
            200,
            "fault: reset after 20 bytes",
        )


async def test_reset_after_zero_bytes_sends_only_headers(session):
    async with running_sim(SimConfig(faults=Faults(reset_after_bytes=0))) as sim:
        raw = bytearray()
        with pytest.raises((aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError)):
            assert await _read_partial(session, sim.url + CHAT, body_for(CHAT), raw) == 200
        assert raw == b""
        assert sim.generation_requests()[0].error == "fault: reset after 0 bytes"


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_hang_after_tokens_streaming(session, path):
    async with running_sim(SimConfig(faults=Faults(hang_after_tokens=3))) as sim:
        raw = bytearray()
        body = body_for(path, 8, stream=True)
        task = asyncio.create_task(_read_partial(session, sim.url + path, body, raw))
        await wait_for(lambda: len(_tokens(raw)) == 3)
        await asyncio.sleep(0.2)  # silence: no fourth token, no [DONE], connection open
        assert len(_tokens(raw)) == 3 and b"[DONE]" not in raw and not task.done()
        if path == CHAT:
            assert orjson.loads(sse_events(bytes(raw))[0])["choices"][0]["delta"]["role"]
        assert sim.gauges().running == 1
        record = sim.generation_requests()[0]
        assert record.outcome == "pending"
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await wait_for(lambda: record.outcome == "client_disconnected")
        await wait_for(lambda: sim.gauges().running == 0)
        assert sim.counters.client_disconnects == 1


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("decode_tps", [0, 500])  # inline and paced
async def test_error_after_tokens_streams_vllm_s_error_event(session, path, decode_tps):
    async with running_sim(SimConfig(decode_tps=decode_tps)) as sim:
        sim.set_faults(error_after_tokens=3)
        status, raw = await post(session, sim.url + path, body_for(path, 8, stream=True))
        assert status == 200
        head, _, _ = raw.rpartition(b'data: {"error"')
        assert len(_tokens(head)) == 3
        # vLLM's bytes: json.dumps' separators, then [DONE]
        assert raw.endswith(
            b'data: {"error": {"message": "Internal server error", "type": "InternalServerError",'
            b' "param": null, "code": 500}}\n\ndata: [DONE]\n\n'
        )
        assert sim.generation_requests()[-1].error == "fault: error after 3 tokens"
        status, _ = await post(session, sim.url + path, body_for(path, 8))
        assert status == 500  # a whole answer: vLLM's 500
        status, raw = await post(session, sim.url + path, body_for(path, 3, stream=True))
        assert status == 200 and b'"error"' not in raw  # N tokens or fewer: completes


async def test_hang_after_tokens_non_streaming(session):
    async with running_sim(SimConfig()) as sim:
        sim.set_faults(hang_after_tokens=3)
        status, _ = await post(session, sim.url + COMPLETIONS, body_for(COMPLETIONS, 3))
        assert status == 200  # N tokens or fewer: completes, as close_after_tokens
        task = asyncio.create_task(post(session, sim.url + COMPLETIONS, body_for(COMPLETIONS)))
        await wait_for(lambda: sim.gauges().running == 1)
        await asyncio.sleep(0.1)
        assert not task.done()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        record = sim.generation_requests()[-1]
        await wait_for(lambda: record.outcome == "client_disconnected")
        await wait_for(lambda: sim.gauges().running == 0)


@pytest.mark.parametrize("stream", [False, True])
async def test_fail_kv_load_on_a_nixl_round_trip(session, stream):
    async with (
        running_sim(SimConfig(role="prefill")) as p,
        running_sim(SimConfig(role="decode", faults=Faults(fail_kv_load=True))) as d,
    ):
        body = body_for(COMPLETIONS, stream=stream)
        params = await prefill(session, p.url, COMPLETIONS, body)
        assert params is not None
        status, raw = await post(
            session, d.url + COMPLETIONS, {**body, "kv_transfer_params": params}
        )
        if stream:  # vLLM reports an engine error inside a 200 stream
            assert status == 200
            events = sse_events(raw)
            assert orjson.loads(events[0])["error"]["code"] == 500 and events[-1] == b"[DONE]"
        else:
            assert status == 500
            assert orjson.loads(raw)["error"]["type"] == "InternalServerError"
        assert d.counters.kv_load_failures == 1 and p.counters.kv_bytes_sent == 0
        assert d.generation_requests()[0].outcome == "error"
        status, _ = await post(session, d.url + COMPLETIONS, body)  # no remote KV: unaffected
        assert status == 200


async def _timed_get(session, url: str) -> tuple[int, bytes, float]:
    started = time.monotonic()
    async with session.get(url) as resp:
        return resp.status, await resp.read(), time.monotonic() - started


async def test_health_delay_does_not_block_other_requests(session):
    async with running_sim(SimConfig(faults=Faults(health_delay_s=0.3))) as sim:
        health = asyncio.create_task(_timed_get(session, sim.url + "/health"))
        await wait_for(lambda: any(r.path == "/health" for r in sim.requests))
        status, _, _ = await _timed_get(session, sim.url + "/v1/models")
        assert status == 200 and not health.done()
        status, body, took = await health
        assert (status, body) == (200, b"") and took >= 0.3
        sim.set_faults(health_delay_s=0.1, health_status=500)
        status, _, took = await _timed_get(session, sim.url + "/ping")
        assert status == 500 and took >= 0.1


async def test_health_delay_is_cancelled_when_the_client_leaves():
    async with running_sim(SimConfig(faults=Faults(health_delay_s=5))) as sim:
        async with aiohttp.ClientSession() as own:
            health = asyncio.create_task(_timed_get(own, sim.url + "/health"))
            await wait_for(lambda: any(c.task for c in sim._server.state.connections))
            (conn,) = sim._server.state.connections
            task = conn.task
            assert task is not None
            health.cancel()
            await asyncio.gather(health, return_exceptions=True)
        await wait_for(task.done)
        assert task.cancelled()


async def test_health_status(session):
    async with running_sim(SimConfig(faults=Faults(health_status=503))) as sim:
        for path in ("/health", "/ping"):
            async with session.get(sim.url + path) as resp:
                assert (resp.status, await resp.read()) == (503, b"")
        status, _ = await post(session, sim.url + CHAT, body_for(CHAT))
        assert status == 200
        sim.clear_faults()
        async with session.get(sim.url + "/health") as resp:
            assert resp.status == 200


async def test_new_faults_over_http(session):
    fields = {
        "headers_delay_s": 0.5,
        "reset_after_bytes": 7,
        "hang_after_tokens": 2,
        "fail_kv_load": True,
        "health_delay_s": 0.25,
        "health_status": 500,
    }
    async with running_sim(SimConfig()) as sim:
        async with session.post(sim.url + "/sim/faults", json=fields) as resp:
            assert resp.status == 200
        assert sim.faults == Faults(**fields)
        async with session.get(sim.url + "/sim/faults") as resp:
            assert {k: v for k, v in (await resp.json()).items() if k in fields} == fields
        for bad in ({"health_status": 99}, {"reset_after_bytes": -1}, {"health_delay_s": -1}):
            async with session.post(sim.url + "/sim/faults", json=bad) as resp:
                assert resp.status == 400, bad
        async with session.post(sim.url + "/sim/faults", json={"health_status": 503}) as resp:
            assert resp.status == 200
        async with session.get(sim.url + "/health") as resp:
            assert resp.status == 503


async def test_kill_resets_everything_and_restart_serves_on_the_same_port(session):
    async with running_sim(SimConfig(decode_tps=50)) as sim:
        url, port = sim.url, sim.port
        streams = [bytearray(), bytearray()]
        body = body_for(CHAT, 100, stream=True)
        tasks = [asyncio.create_task(_read_partial(session, url + CHAT, body, r)) for r in streams]
        tasks.append(asyncio.create_task(post(session, url + COMPLETIONS, body_for(COMPLETIONS))))
        await wait_for(lambda: all(len(_tokens(r)) >= 1 for r in streams))
        await wait_for(lambda: sim.gauges().running == 3)
        started = time.monotonic()
        await sim.kill()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 1)
        assert time.monotonic() - started < 1
        assert all(isinstance(r, aiohttp.ClientError) for r in results), results
        assert not await _connects(url)
        assert sim.gauges().running == 0 and not sim._server.state.connections
        await sim.kill()  # idempotent
        await sim.restart()
        assert (sim.url, sim.port) == (url, port)
        assert sim.requests == [] and sim.counters.requests_received == 0
        status, _ = await post(session, url + COMPLETIONS, body_for(COMPLETIONS))
        assert status == 200
        await sim.kill()  # running_sim's exit copes with a killed sim


async def test_restart_keeps_kv_port_and_loses_held_kv(session):
    async with (
        running_sim(SimConfig(role="prefill")) as p,
        running_sim(SimConfig(role="decode")) as d,
    ):
        body = body_for(COMPLETIONS)
        kv_port = p.kv_port
        stale = await prefill(session, p.url, COMPLETIONS, body)
        await p.restart()  # while running: killed first
        assert p.kv_port == kv_port and p.gauges().kv_usage == 0
        status, _ = await post(session, d.url + COMPLETIONS, {**body, "kv_transfer_params": stale})
        assert status == 200 and d.counters.kv_load_failures == 1  # the held KV died with P
        params = await prefill(session, p.url, COMPLETIONS, body)
        assert params is not None and params["remote_port"] == kv_port
        status, _ = await post(session, d.url + COMPLETIONS, {**body, "kv_transfer_params": params})
        assert status == 200
        assert p.counters.kv_transfers == 1 and d.counters.kv_transfers == 1
        assert d.counters.tokens_external_kv_transfer > 0
