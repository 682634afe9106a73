"""The fault matrix for the pass-through endpoints (one decode, no PD): an engine that dies,
hangs or resets, and a client that leaves, with the matrix's invariants
(``harness.assert_settled``): nothing in flight, no connection or task left behind."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson
import pytest

from pdproxy.config.scheduling import SchedulingConfig
from tests.faults.harness import MODEL, TIMEOUTS, assert_settled, fleet

ROUND_ROBIN_DECODES = SchedulingConfig(decode_policy="round-robin")

pytestmark = pytest.mark.faults

RESPONSES = "/v1/responses"
EMBEDDINGS = "/v1/embeddings"


def _responses(i: int, *, stream: bool, tokens: int = 8) -> dict[str, Any]:
    return {
        "model": MODEL,
        "input": f"conversation {i}",
        "max_output_tokens": tokens,
        "stream": stream,
    }


async def _post(session, url: str, path: str, body: dict[str, Any]) -> tuple[int, bytes, float]:
    started = time.monotonic()
    async with session.post(url + path, json=body) as r:
        return r.status, await r.read(), time.monotonic() - started


def _stream_error(raw: bytes) -> str | None:
    """The error type a Responses stream ended with (None: it completed); exactly one
    terminal event either way."""
    events = [block.split("\n", 1) for block in raw.decode().split("\n\n") if block]
    names = [name.removeprefix("event: ") for name, _ in events]
    assert names[0] == "response.created", names
    last = orjson.loads(events[-1][1].removeprefix("data: "))
    if names[-1] == "response.completed":
        assert "error" not in names
        return None
    assert names[-1] == "error" and names.count("error") == 1, names
    return str(last["error"]["type"])


def _sent(sims, path: str) -> list:
    return [r for s in sims for r in s.requests if r.path == path]


async def test_engine_killed_mid_stream_ends_with_one_error_event():
    async with fleet() as f:
        for d in f.decodes:
            d.set_faults(close_after_tokens=3)
        async with aiohttp.ClientSession() as s:
            outcomes = await asyncio.gather(
                *(_post(s, f.proxy.url, RESPONSES, _responses(i, stream=True)) for i in range(4))
            )
        assert all(status == 200 for status, _, _ in outcomes)
        assert [_stream_error(raw) for _, raw, _ in outcomes] == ["BadGatewayError"] * 4
        assert len(_sent(f.decodes, RESPONSES)) == 4  # never retried: the client had bytes
        assert (
            f.metric("pdproxy_requests_total", endpoint=RESPONSES, outcome="UpstreamProtocolError")
            == 4
        )
        await assert_settled(f)


async def test_engine_hung_mid_stream_ends_with_one_error_event_in_time():
    async with fleet() as f:
        for d in f.decodes:
            d.set_faults(hang_after_tokens=2)
        async with aiohttp.ClientSession() as s:
            status, raw, seconds = await _post(
                s, f.proxy.url, RESPONSES, _responses(0, stream=True)
            )
        assert status == 200 and _stream_error(raw) == "GatewayTimeoutError"
        assert seconds < TIMEOUTS.read + 2.0  # read timeout + watchdog tick
        await assert_settled(f)


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ({"reset_after_bytes": 5}, "reset"),
        ({"hang": True}, "timeout"),
        ({"status": 500}, "5xx"),
    ],
)
async def test_a_decode_failing_before_the_first_byte_is_retried(fault, reason):
    # Round robin, so the failing decode is certainly picked within the 4 requests.
    async with fleet(proxy={"scheduling": ROUND_ROBIN_DECODES}) as f:
        f.decodes[0].set_faults(**fault)
        async with aiohttp.ClientSession() as s:
            for i in range(4):
                body = {"model": MODEL, "input": f"embed {i}"}
                status, raw, seconds = await _post(s, f.proxy.url, EMBEDDINGS, body)
                assert status == 200, raw
                assert seconds < TIMEOUTS.read + 2.0
        assert f.metric("pdproxy_retries_total", leg="decode", reason=reason) >= 1
        await assert_settled(f)


async def test_a_killed_decode_is_routed_around():
    async with fleet() as f:
        await f.decodes[0].kill()
        async with aiohttp.ClientSession() as s:
            for i in range(6):
                status, _, _ = await _post(
                    s, f.proxy.url, RESPONSES, _responses(i, stream=i % 2 == 0)
                )
                assert status == 200
        await assert_settled(f)


async def test_client_leaves_mid_stream():
    async with fleet(decode_tps=50) as f:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(
                f.proxy.url + RESPONSES, json=_responses(0, stream=True, tokens=200)
            )
            await resp.content.readuntil(b"\n\n")
            resp.close()
        await assert_settled(f)
        assert [r.outcome for r in _sent(f.decodes, RESPONSES)] == ["client_disconnected"]
        assert (
            f.metric("pdproxy_requests_total", endpoint=RESPONSES, outcome="client_disconnected")
            == 1
        )


async def test_client_leaves_while_the_engine_is_silent():
    async with fleet() as f:
        for d in f.decodes:
            d.set_faults(headers_delay_s=0.5)
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(
                session.post(f.proxy.url + "/score", json={"queries": "q", "documents": ["d"]})
            )
            await asyncio.sleep(0.2)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await assert_settled(f)
        assert [r.outcome for r in _sent(f.decodes, "/score")] == ["client_disconnected"]
        assert (
            f.metric("pdproxy_requests_total", endpoint="/score", outcome="client_disconnected")
            == 1
        )
