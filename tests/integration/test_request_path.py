"""pdproxy under real uvicorn in front of 2 prefill + 2 decode sims on loopback."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from tests.integration.conftest import MODEL, deployment

PROMPT = "Disaggregated serving splits prefill from decode so each can scale on its own terms"
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPT}]


def _body(kind: str, stream: bool, prompt: str = PROMPT, **extra):
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0, "stream": stream, **extra}
    if kind == "chat":
        body["messages"] = [CHAT[0], {"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def _path(kind: str) -> str:
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions"


async def _call(base: str, kind: str, body: dict, headers=None):
    """Returns (status, content-type, text output, raw bytes)."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(base + _path(kind), json=body, headers=headers) as r,
    ):
        raw = await r.read()
        return (
            r.status,
            r.headers.get("Content-Type", ""),
            _text(kind, body.get("stream", False), raw),
            raw,
            r.headers,
        )


def _text(kind: str, stream: bool, raw: bytes) -> str | None:
    def piece(choice):
        if kind == "chat":
            return (choice.get("delta") or choice.get("message") or {}).get("content") or ""
        return choice.get("text", "")

    try:
        if not stream:
            return "".join(piece(c) for c in orjson.loads(raw)["choices"])
        out = []
        for line in raw.split(b"\n"):
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                event = orjson.loads(line[6:])
                out.extend(piece(c) for c in event.get("choices", []))
        return "".join(out)
    except (orjson.JSONDecodeError, KeyError):
        return None


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
async def test_output_equals_single_engine_and_kv_moved(nixl_2p2d, kind, stream):
    d = nixl_2p2d
    for _ in range(4):  # round robin visits every P and D
        body = _body(kind, stream)
        status, ctype, text, _raw, _ = await _call(d.proxy.url, kind, body)
        ref_status, _, ref_text, _, _ = await _call(d.single.url, kind, body)
        assert status == ref_status == 200
        assert text and text == ref_text
        assert ctype.startswith("text/event-stream" if stream else "application/json")
    assert all(sim.counters.kv_transfers >= 1 for sim in d.engines)
    assert (
        sum(s.counters.kv_bytes_sent for s in d.prefills)
        == sum(s.counters.kv_bytes_received for s in d.decodes)
        > 0
    )
    assert sum(s.counters.tokens_external_kv_transfer for s in d.decodes) > 0
    # like vLLM, a decode recomputes at most the last prompt token (for its logits)
    assert sum(s.counters.tokens_local_compute for s in d.decodes) <= 4
    assert all(s.counters.contract_violations == 0 for s in d.engines)


async def test_each_request_reaches_one_p_and_one_d_with_one_id(nixl_2p2d):
    d = nixl_2p2d
    ids = []
    for i in range(8):
        headers = {"X-Request-Id": f"client-{i}"} if i % 2 else None
        status, _, _, _, resp_headers = await _call(
            d.proxy.url, "completions", _body("completions", i % 3 == 0), headers
        )
        assert status == 200
        ids.append(resp_headers["x-request-id"])
    assert ids[1] == "client-1" and len(ids[0]) == 32
    p_ids = [r.headers["x-request-id"] for r in d.generation_requests(d.prefills)]
    d_ids = [r.headers["x-request-id"] for r in d.generation_requests(d.decodes)]
    assert sorted(p_ids) == sorted(d_ids) == sorted(ids)
    assert [len(s.generation_requests()) for s in d.engines] == [4, 4, 4, 4]
    for record in d.generation_requests(d.prefills):
        body = record.body
        assert body["max_tokens"] == 1 and body["stream"] is False
        assert "stream_options" not in body
        assert body["kv_transfer_params"]["do_remote_decode"] is True


async def test_prefill_clamps_chat_token_fields(nixl_2p2d):
    d = nixl_2p2d
    body = _body(
        "chat", True, max_completion_tokens=7, min_tokens=3, stream_options={"include_usage": True}
    )
    status, _, text, raw, _ = await _call(d.proxy.url, "chat", body)
    assert status == 200 and text
    assert b'"usage"' in raw  # include_usage honoured on the decode leg
    (p_record,) = d.generation_requests(d.prefills)
    assert p_record.body["max_completion_tokens"] == 1 and p_record.body["max_tokens"] == 1
    assert "min_tokens" not in p_record.body and "stream_options" not in p_record.body
    (d_record,) = d.generation_requests(d.decodes)
    assert d_record.body["max_completion_tokens"] == 7 and d_record.body["min_tokens"] == 3


async def test_client_kv_params_never_reach_engines(nixl_2p2d):
    d = nixl_2p2d
    evil = {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 1}
    status, *_ = await _call(
        d.proxy.url, "completions", _body("completions", False, kv_transfer_params=evil)
    )
    assert status == 200
    (d_record,) = d.generation_requests(d.decodes)
    assert d_record.body["kv_transfer_params"]["remote_host"] == "127.0.0.1"


async def test_authorization_forwarded_to_both_legs(nixl_2p2d):
    d = nixl_2p2d
    await _call(
        d.proxy.url, "completions", _body("completions", False), {"Authorization": "Bearer sk-test"}
    )
    records = d.generation_requests(d.engines)
    assert len(records) == 2 and all(
        r.headers["authorization"] == "Bearer sk-test" for r in records
    )


@pytest.mark.parametrize("kind", ["completions", "chat"])
async def test_example_connector_output_equal(tmp_path, kind):
    async with deployment(1, 1, connector="example", tmp_path=tmp_path) as d:
        # like vLLM's ExampleConnector, only whole blocks move: the prompt spans several
        prompt_body = _body(kind, False, prompt=" ".join([PROMPT] * 4))
        status, _, text, _, _ = await _call(d.proxy.url, kind, prompt_body)
        _, _, ref, _, _ = await _call(d.single.url, kind, prompt_body)
        assert status == 200 and text == ref
        assert d.decodes[0].counters.tokens_external_kv_transfer > 0
        (p_record,) = d.prefills[0].generation_requests()
        assert "kv_transfer_params" not in p_record.body and p_record.body["max_tokens"] == 1


async def test_status_and_models(nixl_2p2d):
    d = nixl_2p2d
    async with aiohttp.ClientSession() as s:
        async with s.get(d.proxy.url + "/status") as r:
            status = await r.json()
        assert status["prefill_node_count"] == 2 and status["decode_node_count"] == 2
        assert status["prefill_nodes"] == [p.url.removeprefix("http://") for p in d.prefills]
        async with s.get(d.proxy.url + "/health") as r:
            assert r.status == 200
        d.decodes[0].set_faults(refuse_connections=True)
        async with s.get(d.proxy.url + "/v1/models") as r:
            assert r.status == 200
            models = await r.json()
        assert [m["id"] for m in models["data"]] == [MODEL]


async def test_whole_streams_count_as_ok_and_pool_their_decode_connections(monkeypatch):
    """uvicorn's receive() reports a disconnect once a response is complete; the handler,
    still reading the engine's end of the stream, must not take it for a client that left
    (it did for about half the streams: counted client_disconnected, connection dropped)."""
    from pdproxy.upstream.http1.pool import Pool

    connects = 0
    connect = Pool._connect

    async def counted(self, *args, **kwargs):
        nonlocal connects
        connects += 1
        return await connect(self, *args, **kwargs)

    monkeypatch.setattr(Pool, "_connect", counted)
    async with deployment(n_prefill=1, n_decode=1) as d, aiohttp.ClientSession() as s:

        async def one(i: int) -> bytes:
            body = {"model": MODEL, "prompt": f"{PROMPT} {i}", "max_tokens": 16, "stream": True}
            async with s.post(d.proxy.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                return await r.read()

        for batch in range(6):
            answers = await asyncio.gather(*(one(32 * batch + i) for i in range(32)))
            assert all(a.endswith(b"data: [DONE]\n\n") for a in answers)
        registry = d.proxy.state.metrics.registry

        def requests(outcome: str) -> float:
            labels = {"endpoint": "/v1/completions", "outcome": outcome}
            return registry.get_sample_value("pdproxy_requests_total", labels) or 0.0

        assert requests("ok") == 6 * 32 and requests("client_disconnected") == 0
        assert connects <= 2 * 32  # one per concurrent leg and engine, reused by every batch
