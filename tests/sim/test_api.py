"""vLLM's OpenAI surface on a single sim (role both)."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from engines.sim import SimConfig, running_sim
from tests.sim.helpers import CHAT, COMPLETIONS, MODEL, body_for, post, prefill, sse_events, text_of


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_non_streaming_shape_and_usage(session, path):
    async with running_sim(SimConfig()) as sim:
        status, raw = await post(
            session, sim.url + path, body_for(path, 5), headers={"X-Request-Id": "abc"}
        )
    assert status == 200
    data = orjson.loads(raw)
    prefix, obj = (
        ("cmpl", "text_completion") if path == COMPLETIONS else ("chatcmpl", "chat.completion")
    )
    assert data["id"] == f"{prefix}-abc" and data["object"] == obj and data["model"] == MODEL
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 5
    assert data["usage"]["total_tokens"] == data["usage"]["prompt_tokens"] + 5
    assert data["kv_transfer_params"] is None
    assert len(text_of(raw, False).split()) == 5


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_streaming_matches_non_streaming(session, path):
    async with running_sim(SimConfig()) as sim:
        _, full = await post(session, sim.url + path, body_for(path, 6))
        body = body_for(path, 6, stream=True, stream_options={"include_usage": True})
        async with session.post(sim.url + path, json=body) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            raw = await resp.read()
    events = sse_events(raw)
    assert events[-1] == b"[DONE]"
    usage_chunk = orjson.loads(events[-2])
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 6
    assert orjson.loads(events[-3])["choices"][0]["finish_reason"] == "length"
    assert text_of(raw, True) == text_of(full, False)


async def test_request_id_from_body_and_random(session):
    async with running_sim(SimConfig()) as sim:
        _, raw = await post(session, sim.url + COMPLETIONS, body_for(COMPLETIONS, request_id="b1"))
        assert orjson.loads(raw)["id"] == "cmpl-b1"
        _, raw = await post(
            session, sim.url + COMPLETIONS, body_for(COMPLETIONS), headers={"X-Request-Id": "h1"}
        )
        assert orjson.loads(raw)["id"] == "cmpl-h1"
        _, raw = await post(session, sim.url + COMPLETIONS, body_for(COMPLETIONS))
        assert len(orjson.loads(raw)["id"]) > len("cmpl-")


async def test_max_tokens_stop_and_token_ids(session):
    async with running_sim(SimConfig()) as sim:
        _, raw = await post(session, sim.url + COMPLETIONS, body_for(COMPLETIONS, 12))
        words = text_of(raw, False).split()
        stop_body = body_for(COMPLETIONS, 12, stop=[" " + words[3]])
        _, raw = await post(session, sim.url + COMPLETIONS, stop_body)
        choice = orjson.loads(raw)["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["stop_reason"] == " " + words[3]
        assert choice["text"].split() == words[: words.index(words[3])]
        status, raw = await post(
            session, sim.url + COMPLETIONS, {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}
        )
        assert status == 200 and orjson.loads(raw)["usage"]["prompt_tokens"] == 3


async def test_chat_prefers_max_completion_tokens(session):
    async with running_sim(SimConfig()) as sim:
        body = {**body_for(CHAT, 3), "max_tokens": 7}
        _, raw = await post(session, sim.url + CHAT, body)
    assert orjson.loads(raw)["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize(
    ("data", "status", "err_type", "message"),
    [
        (b"{not json", 400, "BadRequestError", "JSON decode error"),
        (b"[1]", 400, "BadRequestError", "valid dictionary"),
        (
            b'{"model": "other", "prompt": "x"}',
            404,
            "NotFoundError",
            "The model `other` does not exist.",
        ),
        (b'{"model": "sim-model"}', 400, "BadRequestError", "prompt"),
        (
            b'{"model": "sim-model", "prompt": "x", "max_tokens": 0}',
            400,
            "BadRequestError",
            "max_tokens",
        ),
        (
            b'{"model": "sim-model", "prompt": "x", "max_tokens": 99999}',
            400,
            "BadRequestError",
            "maximum context length",
        ),
    ],
)
async def test_malformed_bodies_get_vllm_errors(session, data, status, err_type, message):
    async with running_sim(SimConfig()) as sim:
        async with session.post(sim.url + COMPLETIONS, data=data) as resp:
            assert resp.status == status
            err = orjson.loads(await resp.read())["error"]
        assert sim.requests[-1].outcome == "error"
    assert (
        err["type"] == err_type
        and err["code"] == status
        and err["param"] == ("model" if status == 404 else None)
    )
    assert message in err["message"]


async def test_data_parallel_rank(session):
    async with running_sim(SimConfig(dp_size=2)) as sim:
        for rank, want in (("0", 200), ("1", 200), ("x", 200), ("2", 400)):
            status, raw = await post(
                session,
                sim.url + COMPLETIONS,
                body_for(COMPLETIONS),
                headers={"X-data-parallel-rank": rank},
            )
            assert status == want, rank
    assert orjson.loads(raw)["error"]["message"] == "data_parallel_rank 2 is out of range [0, 2)."
    async with running_sim(SimConfig()) as sim:
        status, raw = await post(
            session,
            sim.url + COMPLETIONS,
            body_for(COMPLETIONS),
            headers={"X-data-parallel-rank": "1"},
        )
    assert status == 400
    assert orjson.loads(raw)["error"]["message"] == "data_parallel_rank 1 is out of range [0, 1)."


async def test_models_health_metrics_and_records(session):
    async with running_sim(SimConfig(model="m1")) as sim:
        async with session.get(sim.url + "/v1/models") as resp:
            assert orjson.loads(await resp.read())["data"][0]["id"] == "m1"
        async with session.get(sim.url + "/health") as resp:
            assert resp.status == 200
        body = {"model": "m1", "prompt": "hi", "max_tokens": 2}
        await post(session, sim.url + COMPLETIONS, body, headers={"X-Request-Id": "r1"})
        async with session.get(sim.url + "/metrics") as resp:
            text = await resp.text()
        async with session.get(sim.url + "/sim/requests") as resp:
            records = orjson.loads(await resp.read())
        async with session.delete(sim.url + "/sim/requests") as resp:
            assert resp.status == 200
        assert sim.requests == []
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        'source="external_kv_transfer"',
        'source="local_compute"',
        "sim_kv_bytes_sent_total",
        "sim_kv_bytes_received_total",
        "sim_kv_transfers_total",
        "sim_contract_violations_total",
        "sim_client_disconnects_total",
        "sim_kv_load_failures_total",
        "vllm:prefix_cache_hits_total",
    ):
        assert name in text
    gen = [r for r in records if r["path"] == COMPLETIONS]
    assert gen[0]["headers"]["x-request-id"] == "r1" and gen[0]["body"] == body
    assert gen[0]["outcome"] == "completed" and gen[0]["method"] == "POST"


async def test_unknown_path_and_method(session):
    async with running_sim(SimConfig()) as sim:
        async with session.get(sim.url + "/nope") as resp:
            assert resp.status == 404
        async with session.get(sim.url + COMPLETIONS) as resp:
            assert resp.status == 405


async def test_missing_model_uses_the_served_model(session):
    # vLLM's _is_model_supported: an empty or missing model name means the served model
    async with running_sim(SimConfig()) as sim:
        status, raw = await post(session, sim.url + COMPLETIONS, {"prompt": "hi", "max_tokens": 1})
    assert status == 200 and orjson.loads(raw)["model"] == MODEL


async def test_expect_continue_and_pipelining():
    async with running_sim(SimConfig()) as sim:
        reader, writer = await asyncio.open_connection("127.0.0.1", sim.port)
        body = b'{"prompt": "hi", "max_tokens": 1}'
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n" % len(body)
        writer.write(head + b"Expect: 100-continue\r\n\r\n")
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(body + head + b"\r\n" + body)  # a second request, pipelined
        for _ in range(2):
            assert (await reader.readuntil(b"\r\n")).startswith(b"HTTP/1.1 200")
            headers = await reader.readuntil(b"\r\n\r\n")
            length = int(headers.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
        writer.close()
        await writer.wait_closed()


async def test_sim_counters_endpoint(session):
    async with running_sim(SimConfig()) as sim:
        await post(session, sim.url + COMPLETIONS, body_for(COMPLETIONS, 2))
        async with session.get(sim.url + "/sim/counters") as resp:
            data = orjson.loads(await resp.read())
    assert data["generation_tokens"] == 2 and data["kv_port"] == sim.kv_port
    assert data["running"] == 0 and data["kv_usage"] == 0


async def test_exit_leaves_nothing_running(session):
    async with running_sim(SimConfig(role="prefill", ttft_ms=5000)) as sim:
        url, kv_port = sim.url, sim.kv_port
        pending = asyncio.create_task(post(session, url + COMPLETIONS, body_for(COMPLETIONS)))
        await asyncio.sleep(0.05)
    await asyncio.gather(pending, return_exceptions=True)
    assert asyncio.all_tasks() == {asyncio.current_task()}
    assert sim.generation_requests()[0].error == "aborted: server stopping"
    for port in (sim.port, kv_port):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            continue
        writer.close()
        raise AssertionError(f"port {port} still accepts connections")
    async with running_sim(SimConfig(role="prefill")) as p:
        assert await prefill(session, p.url, COMPLETIONS, body_for(COMPLETIONS))
        assert p.gauges().kv_usage > 0
    assert p.gauges().kv_usage == 0  # held blocks and their lease timers released
