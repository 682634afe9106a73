"""Every failure reaches the client as the right status and an OpenAI-shaped body."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import orjson
import pytest

from pdproxy.config.upstream import Timeouts
from pdproxy.scheduling.context import RequestFeatures
from tests.integration.conftest import MODEL, deployment

BODY = {"model": MODEL, "prompt": "tell me about the weather in spring", "max_tokens": 40}


async def _post(url: str, body=None, *, data=None, headers=None, path="/v1/completions"):
    async with aiohttp.ClientSession() as s:
        kwargs = (
            {"data": data, "headers": headers}
            if data is not None
            else {"json": body, "headers": headers}
        )
        async with s.post(url + path, **kwargs) as r:
            return r.status, r.headers.get("Content-Type", ""), await r.read()


def _error(raw: bytes) -> dict:
    err = orjson.loads(raw)["error"]
    assert set(err) >= {"message", "type", "code"}
    return err


@pytest.mark.parametrize("stream", [False, True])
async def test_prefill_4xx_is_relayed_and_decode_untouched(nixl_2p2d, stream):
    d = nixl_2p2d
    for p in d.prefills:
        p.set_faults(status=400)
    status, ctype, raw = await _post(d.proxy.url, {**BODY, "stream": stream})
    assert status == 400 and ctype.startswith("application/json")
    assert _error(raw)["code"] == 400  # the sim's own vLLM-shaped body, as it came
    assert d.generation_requests(d.decodes) == []


async def test_prefill_5xx_is_502_and_decode_untouched(nixl_2p2d):
    d = nixl_2p2d
    for p in d.prefills:
        p.set_faults(status=500)
    status, _, raw = await _post(d.proxy.url, BODY)
    assert status == 502 and "prefill" in _error(raw)["message"]
    assert d.generation_requests(d.decodes) == []


async def test_prefill_refused_is_503_and_decode_untouched(nixl_2p2d):
    d = nixl_2p2d
    for p in d.prefills:
        p.set_faults(refuse_connections=True)
    await asyncio.sleep(0.05)
    status, _, raw = await _post(d.proxy.url, {**BODY, "stream": True})
    assert status == 503
    assert _error(raw)["type"] == "ServiceUnavailableError"
    assert d.generation_requests(d.decodes) == []


async def test_prefill_silent_past_timeout_is_504():
    async with deployment(1, 1, proxy={"timeouts": Timeouts(read=0.3)}) as d:
        d.prefills[0].set_faults(hang=True)
        status, _, raw = await _post(d.proxy.url, BODY)
        assert status == 504 and _error(raw)["type"] == "GatewayTimeoutError"
        assert d.generation_requests(d.decodes) == []


@pytest.mark.parametrize("stream", [False, True])
async def test_decode_400_is_400_not_200(nixl_2p2d, stream):
    d = nixl_2p2d
    for dec in d.decodes:
        dec.set_faults(status=400)
    status, ctype, raw = await _post(d.proxy.url, {**BODY, "stream": stream})
    assert status == 400 and ctype.startswith("application/json")
    assert _error(raw)["code"] == 400


async def test_decode_dies_mid_stream_ends_with_one_error_event(nixl_2p2d):
    d = nixl_2p2d
    for dec in d.decodes:
        dec.set_faults(close_after_tokens=3)
    status, ctype, raw = await _post(d.proxy.url, {**BODY, "stream": True})
    assert status == 200 and ctype.startswith("text/event-stream")
    events = [e for e in raw.split(b"\n\n") if e.strip()]
    errors = [e for e in events if b'"error"' in e]
    assert len(errors) == 1 and errors[0].startswith(b"data: ")
    assert orjson.loads(errors[0][6:])["error"]["type"] == "BadGatewayError"
    assert events[-1] == b"data: [DONE]" and events.index(errors[0]) == len(events) - 2
    assert sum(b'"text"' in e for e in events) >= 1
    async with aiohttp.ClientSession() as s, s.get(d.proxy.url + "/metrics") as r:
        metrics = await r.text()
    labels = 'endpoint="/v1/completions",outcome="UpstreamProtocolError"'
    assert f"pdproxy_requests_total{{{labels}}} 1.0" in metrics


async def test_decode_dies_non_streaming_is_502(nixl_2p2d):
    d = nixl_2p2d
    for dec in d.decodes:
        dec.set_faults(close_after_tokens=0)
    status, _, raw = await _post(d.proxy.url, BODY)
    assert status == 502 and _error(raw)["code"] == 502


@pytest.mark.parametrize(
    ("data", "headers", "status", "param"),
    [
        (b"{}", {"Content-Type": "text/plain"}, 415, None),
        (b"{not json", {"Content-Type": "application/json"}, 400, None),
        (b"[1, 2]", {"Content-Type": "application/json"}, 400, None),
        (b'{"prompt": "x"}', {"Content-Type": "application/json"}, 400, "model"),
        (b'{"model": "sim-model"}', {"Content-Type": "application/json"}, 400, "prompt"),
        (
            b'{"model": "sim-model", "prompt": "' + b"x" * 2000 + b'"}',
            {"Content-Type": "application/json"},
            413,
            None,
        ),
    ],
)
async def test_bad_input_is_4xx_and_changes_nothing(data, headers, status, param):
    async with deployment(1, 1, proxy={"max_body_bytes": 1024}) as d:
        got, ctype, raw = await _post(d.proxy.url, data=data, headers=headers)
        assert got == status and ctype.startswith("application/json")
        assert _error(raw)["param"] == param
        assert d.generation_requests(d.engines) == []
        assert all(e.legs.in_flight == 0 for e in d.proxy.state.registry.all())


async def test_chat_requires_messages(nixl_2p2d):
    status, _, raw = await _post(
        nixl_2p2d.proxy.url, {"model": MODEL, "prompt": "x"}, path="/v1/chat/completions"
    )
    assert status == 400 and _error(raw)["param"] == "messages"


async def _wait_for(predicate, timeout=2.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not met in time")


async def test_client_disconnect_mid_stream_closes_decode_fast():
    async with deployment(1, 1, decode_tps=20) as d:
        session = aiohttp.ClientSession()
        resp = await session.post(d.proxy.url + "/v1/completions", json={**BODY, "stream": True})
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")  # the first token arrived
        resp.close()
        closed_at = time.time()
        await session.close()
        record = d.decodes[0].generation_requests()[0]
        await _wait_for(lambda: record.outcome == "client_disconnected")
        assert record.disconnected_at - closed_at < 0.1
        await _wait_for(lambda: all(e.legs.in_flight == 0 for e in d.proxy.state.registry.all()))
        assert d.prefills[0].generation_requests()[0].outcome == "completed"


async def test_client_disconnect_during_prefill_closes_prefill_and_skips_decode():
    async with deployment(1, 1) as d:
        d.prefills[0].set_faults(hang=True)
        session = aiohttp.ClientSession()
        task = asyncio.create_task(
            session.post(d.proxy.url + "/v1/completions", json={**BODY, "stream": True})
        )
        await _wait_for(lambda: d.prefills[0].generation_requests())
        task.cancel()
        closed_at = time.time()
        await asyncio.gather(task, return_exceptions=True)
        await session.close()
        record = d.prefills[0].generation_requests()[0]
        await _wait_for(lambda: record.outcome == "client_disconnected")
        assert record.disconnected_at - closed_at < 0.1
        await _wait_for(lambda: all(e.legs.in_flight == 0 for e in d.proxy.state.registry.all()))
        assert d.generation_requests(d.decodes) == []


class _BrokenScheduler:
    def features(self, body, session):
        return RequestFeatures()

    def schedule(self, features, snapshot):
        raise RuntimeError("internal detail that must not leak")


async def test_proxy_bug_is_generic_500_without_exception_text(nixl_2p2d, caplog):
    nixl_2p2d.proxy.state.orchestrator._scheduler = _BrokenScheduler()
    status, ctype, raw = await _post(nixl_2p2d.proxy.url, BODY)
    assert status == 500 and ctype.startswith("application/json")
    assert b"internal detail" not in raw and _error(raw)["type"] == "InternalServerError"
    assert "internal detail that must not leak" in caplog.text  # logged with its traceback


async def test_decode_silent_mid_stream_ends_with_timeout_event():
    async with deployment(1, 1, decode_tps=1, proxy={"timeouts": Timeouts(read=0.4)}) as d:
        started = time.monotonic()
        status, _, raw = await _post(d.proxy.url, {**BODY, "stream": True, "max_tokens": 5})
        assert status == 200 and time.monotonic() - started < 3
        events = [e for e in raw.split(b"\n\n") if e.strip()]
        assert orjson.loads(events[-2][6:])["error"]["type"] == "GatewayTimeoutError"
        assert events[-1] == b"data: [DONE]"
        record = d.decodes[0].generation_requests()[0]
        await _wait_for(lambda: record.outcome == "client_disconnected")  # vLLM would abort


async def test_decode_silent_non_streaming_is_504():
    async with deployment(1, 1, proxy={"timeouts": Timeouts(read=0.3)}) as d:
        d.decodes[0].set_faults(hang=True)
        status, _, raw = await _post(d.proxy.url, BODY)
        assert status == 504 and _error(raw)["type"] == "GatewayTimeoutError"
