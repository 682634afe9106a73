"""Concurrent legs (push / WRITE transfers): a failed prefill never leaves the client waiting."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest

from tests.integration.conftest import MODEL, deployment

BODY = {"model": MODEL, "prompt": "concurrent legs share one transfer id", "max_tokens": 8}
WRITE = {"kv_connector": "moriio", "transfer_mode": "WRITE"}


async def _post(url, body):
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.read()


@pytest.mark.parametrize("stream", [False, True])
async def test_prefill_failure_cancels_waiting_decode(stream):
    async with deployment(1, 1, proxy=WRITE) as d:
        d.prefills[0].set_faults(status=500)
        d.decodes[0].set_faults(hang=True)  # a decode waiting for KV that will never come
        started = time.monotonic()
        status, raw = await asyncio.wait_for(_post(d.proxy.url, {**BODY, "stream": stream}), 5)
        assert status == 502 and orjson.loads(raw)["error"]["code"] == 502
        assert time.monotonic() - started < 2
        record = d.decodes[0].generation_requests()[0]
        for _ in range(100):
            if record.outcome == "client_disconnected":
                break
            await asyncio.sleep(0.01)
        assert record.outcome == "client_disconnected"  # the proxy dropped the decode leg
        assert all(e.legs.in_flight == 0 for e in d.proxy.state.registry.all())


async def test_prefill_failure_after_decode_stream_started_ends_with_error_event():
    async with deployment(1, 1, proxy=WRITE, decode_tps=20) as d:
        d.prefills[0].set_faults(hang=True)
        session = aiohttp.ClientSession()
        try:
            resp = await session.post(
                d.proxy.url + "/v1/completions", json={**BODY, "stream": True, "max_tokens": 30}
            )
            assert resp.status == 200
            await resp.content.readuntil(b"\n\n")
            d.prefills[0].set_faults(status=500)
            # the hung prefill leg is still open: closing the sim's connections makes it fail
            await d.prefills[0]._server.stop()
            raw = await asyncio.wait_for(resp.read(), 5)
        finally:
            await session.close()
        events = [e for e in raw.split(b"\n\n") if e.strip()]
        assert b'"error"' in events[-2] and events[-1] == b"data: [DONE]"
        assert orjson.loads(events[-2][6:])["error"]["message"].startswith("prefill")


async def test_both_legs_sent_together_with_one_id_and_transfer_id():
    async with deployment(1, 1, proxy=WRITE) as d:
        d.prefills[0].set_faults(hang=True)
        task = asyncio.create_task(_post(d.proxy.url, BODY))
        for _ in range(200):
            if d.decodes[0].generation_requests():
                break
            await asyncio.sleep(0.01)
        (p,) = d.prefills[0].generation_requests()
        (dec,) = d.decodes[0].generation_requests()  # D was sent while P still runs
        assert p.headers["x-request-id"] == dec.headers["x-request-id"]
        assert (
            p.body["kv_transfer_params"]["transfer_id"]
            == dec.body["kv_transfer_params"]["transfer_id"]
        )
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
