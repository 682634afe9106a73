"""The pass-through endpoints through a real pdproxy in front of sims: each answered by
exactly one decode, as the sim itself answers, no prefill touched; spread by the decode
policy; a 5xx or refusing decode retried on the other; /v1/responses streamed and its
conversations kept on the instance that holds them; keys, engine key, request ids,
admission, metrics and the access line as for the generation endpoints."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import orjson
import pytest

from engines.sim import model
from pdproxy.config.listener import AdmissionConfig
from pdproxy.config.resilience import RetryConfig
from pdproxy.wire.routes import ROUTES, pin
from tests.integration.conftest import MODEL, deployment

TOKENS = model.tokenize("alpha bravo charlie")  # generated words: every sim knows them
BODIES: dict[str, dict[str, Any] | None] = {
    "/tokenize": {
        "model": MODEL,
        "prompt": "Hello, pass-through world!",
        "return_token_strs": True,
    },
    "/detokenize": {"model": MODEL, "tokens": TOKENS},
    "/v1/completions/render": {"model": MODEL, "prompt": "render this prompt"},
    "/v1/chat/completions/render": {
        "model": MODEL,
        "messages": [{"role": "user", "content": "render this chat"}],
    },
    "/v1/embeddings": {"model": MODEL, "input": ["one", "two words"]},
    "/pooling": {"model": MODEL, "input": "pool these words"},
    "/score": {"model": MODEL, "queries": "a query", "documents": ["first", "second doc"]},
    "/v1/score": {"model": MODEL, "text_1": "a query", "text_2": "a document"},
    "/rerank": {"model": MODEL, "query": "q", "documents": ["x", "y z", "w"], "top_n": 2},
    "/v1/rerank": {"model": MODEL, "query": "q", "documents": ["x", "y z"]},
    "/v2/rerank": {"model": MODEL, "query": "q", "documents": "only one"},
    "/v1/responses": {"model": MODEL, "input": "say something", "max_output_tokens": 5},
    "/version": None,
}
PATHS = [r.path for r in ROUTES]
ID = {"X-Request-Id": "passthrough-test-1"}


async def _call(session, url, path, body=None, headers=None) -> tuple[int, bytes, Any]:
    if body is None and path == "/version":
        request = session.get(url + path, headers=headers)
    else:
        request = session.post(
            url + path, json=BODIES[path] if body is None else body, headers=headers
        )
    async with request as r:
        return r.status, await r.read(), r.headers


def _comparable(path: str, raw: bytes) -> Any:
    """The answer less what vLLM makes fresh each time: timestamps, and a response's ids."""
    data = orjson.loads(raw)
    if isinstance(data, list):  # /v1/completions/render: one request per prompt
        return data
    data.pop("created", None)
    if path == "/v1/responses":
        for key in ("id", "created_at"):
            data.pop(key)
        for item in data["output"]:
            item.pop("id")
    return data


def _sent(sims, path: str) -> list:
    return [r for s in sims for r in s.requests if r.path == path]


def _metric(proxy, name, **labels) -> float:
    return proxy.state.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("path", PATHS)
async def test_one_decode_answers_as_the_engine_itself(path):
    async with deployment() as d, aiohttp.ClientSession() as s:
        status, raw, headers = await _call(s, d.proxy.url, path, headers=ID)
        direct_status, direct, direct_headers = await _call(s, d.single.url, path, headers=ID)
    assert (status, direct_status) == (200, 200), raw
    assert headers["Content-Type"] == direct_headers["Content-Type"]
    assert headers["x-request-id"] == ID["X-Request-Id"]
    if path in ("/tokenize", "/detokenize", "/version"):
        assert raw == direct  # byte for byte
    else:
        assert _comparable(path, raw) == _comparable(path, direct)
    [record] = _sent(d.engines, path)
    assert record in _sent(d.decodes, path) and not _sent(d.prefills, path)
    assert record.headers["x-request-id"] == ID["X-Request-Id"]
    assert record.outcome == "completed"
    assert not [r for p in d.prefills for r in p.requests if r.method == "POST"]
    assert _metric(d.proxy, "pdproxy_requests_total", endpoint=path, outcome="ok") == 1


async def test_the_body_reaches_the_engine_as_the_client_sent_it():
    raw = b'{"model": "sim-model",  "input": ["spaces", "kept"]}'
    async with deployment(n_prefill=1, n_decode=1) as d, aiohttp.ClientSession() as s:
        headers = {"Content-Type": "application/json"}
        async with s.post(d.proxy.url + "/v1/embeddings", data=raw, headers=headers) as r:
            assert r.status == 200
    [record] = _sent(d.decodes, "/v1/embeddings")
    assert record.body == orjson.loads(raw)


async def test_the_decode_policy_spreads_them():
    async with deployment() as d, aiohttp.ClientSession() as s:
        for path in ("/tokenize", "/v1/embeddings"):
            for _ in range(4):
                assert (await _call(s, d.proxy.url, path))[0] == 200
            assert [len(_sent([sim], path)) for sim in d.decodes] == [2, 2]


@pytest.mark.parametrize("fault", [{"status": 503}, {"refuse_connections": True}])
async def test_a_failing_decode_is_retried_on_the_other(fault):
    async with deployment() as d, aiohttp.ClientSession() as s:
        d.decodes[0].set_faults(**fault)
        for path in ("/v1/embeddings", "/v1/responses", "/version"):
            for _ in range(3):
                status, raw, _ = await _call(s, d.proxy.url, path)
                assert status == 200, raw
        reason = "5xx" if "status" in fault else "connect"
        assert _metric(d.proxy, "pdproxy_retries_total", leg="decode", reason=reason) >= 1


async def test_retries_spend_the_fleet_wide_budget():
    no_budget = {"retry": RetryConfig(budget_ratio=0, budget_min_per_sec=0)}
    async with deployment(proxy=no_budget) as d, aiohttp.ClientSession() as s:
        d.decodes[0].set_faults(status=503)
        statuses = [(await _call(s, d.proxy.url, "/pooling"))[0] for _ in range(4)]
        assert sorted(statuses) == [200, 200, 503, 503]  # round-robin: every other one
        assert _metric(d.proxy, "pdproxy_retries_total", leg="decode", reason="5xx") == 0
        assert _metric(d.proxy, "pdproxy_retry_budget_exhausted_total", leg="decode") == 2


async def test_an_engine_4xx_is_relayed_as_it_came_and_never_retried():
    async with deployment() as d, aiohttp.ClientSession() as s:
        for sim in d.decodes:
            sim.set_faults(status=400)
        for _ in range(4):
            status, raw, _ = await _call(s, d.proxy.url, "/rerank")
            assert status == 400
            assert orjson.loads(raw)["error"]["message"] == "Simulated failure (HTTP 400)."
        assert len(_sent(d.decodes, "/rerank")) == 4
        for sim in d.decodes:
            sim.clear_faults()
        bad = await _call(s, d.proxy.url, "/score", {"model": "another-model", "queries": "q"})
        assert bad[0] == 404  # the engine's own answer


async def test_responses_stream_is_relayed_event_by_event():
    body = {**BODIES["/v1/responses"], "stream": True}
    async with deployment() as d, aiohttp.ClientSession() as s:
        status, raw, headers = await _call(s, d.proxy.url, "/v1/responses", body)
        whole = await _call(s, d.proxy.url, "/v1/responses")
        direct = (await _call(s, d.single.url, "/v1/responses", body))[1]
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = _events(raw)
    assert [name for name, _ in events] == [name for name, _ in _events(direct)]
    assert events[-1][0] == "response.completed" and "error" not in raw.decode()
    assert [e["sequence_number"] for _, e in events] == list(range(len(events)))
    deltas = "".join(e["delta"] for name, e in events if name == "response.output_text.delta")
    completed = events[-1][1]["response"]
    assert deltas == completed["output"][0]["content"][0]["text"]
    assert _comparable("/v1/responses", orjson.dumps(completed)) == _comparable(
        "/v1/responses", whole[1]
    )


def _events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in raw.decode().split("\n\n"):
        if block:
            name, data = block.split("\n", 1)
            events.append((name.removeprefix("event: "), orjson.loads(data.removeprefix("data: "))))
    return events


async def _turn(s, url, previous: str | None, text: str) -> dict[str, Any]:
    body = {"model": MODEL, "input": text, "max_output_tokens": 3}
    if previous is not None:
        body["previous_response_id"] = previous
    status, raw, _ = await _call(s, url, "/v1/responses", body)
    assert status == 200, raw
    return orjson.loads(raw)


async def test_a_conversation_stays_on_the_instance_that_holds_it():
    async with deployment(responses_store=True) as d, aiohttp.ClientSession() as s:
        first = await _turn(s, d.proxy.url, None, "hello there")
        other = await _turn(s, d.proxy.url, None, "a second conversation")
        second = await _turn(s, d.proxy.url, first["id"], "and then?")
        third = await _turn(s, d.proxy.url, second["id"], "one more")
        home = next(sim for sim in d.decodes if pin(sim.url) == first["id"][5:13])
        assert [r.body.get("previous_response_id") for r in _sent([home], "/v1/responses")] == [
            None,
            first["id"],
            second["id"],
        ]
        stranger = next(sim for sim in d.decodes if sim is not home)
        assert [r.body["request_id"] for r in _sent([stranger], "/v1/responses")] == [other["id"]]
        assert third["previous_response_id"] == second["id"]
        assert third["usage"]["input_tokens"] > second["usage"]["input_tokens"]


async def test_a_client_named_response_and_kv_params_are_handled():
    async with deployment(n_decode=1, responses_store=True) as d, aiohttp.ClientSession() as s:
        body = {**BODIES["/v1/responses"], "request_id": "resp_mine", "kv_transfer_params": {}}
        status, raw, _ = await _call(s, d.proxy.url, "/v1/responses", body)
        assert status == 200 and orjson.loads(raw)["id"] == "resp_mine"
        [record] = _sent(d.decodes, "/v1/responses")
        assert "kv_transfer_params" not in record.body and record.body["request_id"] == "resp_mine"
        unknown = {**BODIES["/v1/responses"], "previous_response_id": "resp_nowhere"}
        status, raw, _ = await _call(s, d.proxy.url, "/v1/responses", unknown)
        assert status == 404
        assert orjson.loads(raw)["error"]["type"] == "invalid_request_error"


async def test_a_pinned_conversation_is_never_retried_elsewhere():
    async with deployment(responses_store=True) as d, aiohttp.ClientSession() as s:
        first = await _turn(s, d.proxy.url, None, "remember me")
        home = next(sim for sim in d.decodes if pin(sim.url) == first["id"][5:13])
        home.set_faults(status=503)
        body = {**BODIES["/v1/responses"], "previous_response_id": first["id"]}
        status, _, _ = await _call(s, d.proxy.url, "/v1/responses", body)
        assert status == 503  # the engine's own 5xx: no other instance holds the conversation
        assert all(not _sent([sim], "/v1/responses") for sim in d.decodes if sim is not home)


async def test_client_keys_and_the_engine_key():
    keys = {"api_keys": ("client-key",)}
    async with deployment(n_prefill=1, n_decode=1, proxy=keys) as d, aiohttp.ClientSession() as s:
        for path in ("/tokenize", "/version"):
            assert (await _call(s, d.proxy.url, path))[0] == 401
            ok = await _call(s, d.proxy.url, path, headers={"Authorization": "Bearer client-key"})
            assert ok[0] == 200
        assert _sent(d.decodes, "/tokenize")[0].headers["authorization"] == "Bearer client-key"
        assert _metric(
            d.proxy, "pdproxy_requests_total", endpoint="/tokenize", outcome="Unauthorized"
        )
    both = {"api_keys": ("client-key",), "engine_api_key": "engine-key"}
    async with deployment(n_prefill=1, n_decode=1, proxy=both) as d, aiohttp.ClientSession() as s:
        auth = {"Authorization": "Bearer client-key"}
        assert (await _call(s, d.proxy.url, "/pooling", headers=auth))[0] == 200
        assert _sent(d.decodes, "/pooling")[0].headers["authorization"] == "Bearer engine-key"


async def test_admission_covers_them():
    one_at_a_time = {"admission": AdmissionConfig(max_concurrent=1)}
    async with deployment(n_decode=1, proxy=one_at_a_time) as d, aiohttp.ClientSession() as s:
        d.decodes[0].set_faults(headers_delay_s=0.5)
        slow = asyncio.create_task(_call(s, d.proxy.url, "/v1/embeddings"))
        await asyncio.sleep(0.2)
        status, _, headers = await _call(s, d.proxy.url, "/tokenize")
        assert status == 429 and headers["Retry-After"] == "1"
        assert (await slow)[0] == 200


async def test_binary_embeddings_keep_their_metadata_header():
    body = {"model": MODEL, "input": ["a", "b"], "encoding_format": "bytes"}
    async with deployment(n_decode=1) as d, aiohttp.ClientSession() as s:
        status, raw, headers = await _call(s, d.proxy.url, "/v1/embeddings", body)
    assert status == 200 and headers["Content-Type"] == "application/octet-stream"
    metadata = orjson.loads(headers["metadata"])
    assert [item["end"] for item in metadata["data"]][-1] == len(raw)


async def test_methods_bodies_and_unknown_paths():
    async with deployment(n_prefill=1, n_decode=1) as d, aiohttp.ClientSession() as s:
        async with s.get(d.proxy.url + "/tokenize") as r:
            assert r.status == 405
        async with s.post(d.proxy.url + "/version", json={}) as r:
            assert r.status == 405
        async with s.post(d.proxy.url + "/v1/classify", json={}) as r:
            assert r.status == 404
        async with s.post(
            d.proxy.url + "/tokenize", data=b"[1]", headers={"Content-Type": "application/json"}
        ) as r:
            assert r.status == 400
        async with s.post(
            d.proxy.url + "/tokenize", data=b"x", headers={"Content-Type": "text/plain"}
        ) as r:
            assert r.status == 415
        assert not _sent(d.decodes, "/tokenize")


async def test_the_access_line_names_the_instance(caplog):
    caplog.set_level(logging.INFO, logger="pdproxy.access")
    async with deployment(n_prefill=1, n_decode=1) as d, aiohttp.ClientSession() as s:
        await _call(s, d.proxy.url, "/score")
    [fields] = [r.fields for r in caplog.records if r.name == "pdproxy.access"]
    assert fields["endpoint"] == "/score" and fields["decode_url"] == d.decodes[0].url
    assert fields["prefill_url"] is None and fields["status"] == 200 and fields["outcome"] == "ok"
