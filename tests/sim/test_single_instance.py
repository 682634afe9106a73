"""The sim's one-instance endpoints with vLLM 0.32's contract: /tokenize, /detokenize,
/v1/embeddings, /pooling, /score, /rerank and /v1/responses (whole, streamed, stored)."""

from __future__ import annotations

import base64
import math
import struct

import orjson
import pytest

from engines.sim import Faults, SimConfig, running_sim
from engines.sim.cli import build_parser, config_from_args
from engines.sim.pooling import EMBED_DIM
from tests.sim.helpers import MODEL, post


async def _post(session, sim, path, body, headers=None):
    status, raw = await post(session, sim.url + path, body, headers)
    return status, orjson.loads(raw) if raw[:1] == b"{" else raw


async def test_tokenize_and_detokenize_round_trip(session):
    async with running_sim(SimConfig()) as a, running_sim(SimConfig()) as b:
        body = {"model": MODEL, "prompt": "Hello, world!", "return_token_strs": True}
        status, data = await _post(session, a, "/tokenize", body)
        assert status == 200
        assert data["token_strs"] == ["Hello", ",", "world", "!"]
        assert data["count"] == 4 and data["max_model_len"] == 4096
        assert (await _post(session, b, "/tokenize", body))[1] == data  # one tokenizer
        status, back = await _post(session, b, "/detokenize", {"tokens": data["tokens"]})
        assert (status, back) == (200, {"prompt": "Hello, world!"})
        status, err = await _post(session, a, "/detokenize", {"tokens": [12345]})
        assert status == 400 and "out of vocabulary" in err["error"]["message"]


async def test_tokenize_chat_messages(session):
    messages = [{"role": "user", "content": "hi there"}]
    async with running_sim(SimConfig()) as sim:
        _, opened = await _post(session, sim, "/tokenize", {"messages": messages})
        _, closed = await _post(
            session, sim, "/tokenize", {"messages": messages, "add_generation_prompt": False}
        )
        assert opened["count"] > closed["count"]
        assert opened["token_strs"] is None


async def test_embeddings_are_deterministic_unit_vectors(session):
    body = {"model": MODEL, "input": ["one", "two words"]}
    async with running_sim(SimConfig()) as a, running_sim(SimConfig()) as b:
        status, data = await _post(session, a, "/v1/embeddings", body, {"X-Request-Id": "r1"})
        other = (await _post(session, b, "/v1/embeddings", body))[1]
        short = (await _post(session, a, "/v1/embeddings", {**body, "dimensions": 4}))[1]
        coded = (await _post(session, a, "/v1/embeddings", {**body, "encoding_format": "base64"}))[
            1
        ]
    assert status == 200 and data["id"] == "embd-r1" and data["object"] == "list"
    vectors = [item["embedding"] for item in data["data"]]
    assert [item["object"] for item in data["data"]] == ["embedding", "embedding"]
    assert [len(v) for v in vectors] == [EMBED_DIM, EMBED_DIM] and vectors[0] != vectors[1]
    assert all(math.isclose(sum(x * x for x in v), 1.0) for v in vectors)
    assert [item["embedding"] for item in other["data"]] == vectors
    assert data["usage"] == {
        "prompt_tokens": 3,
        "total_tokens": 3,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    assert len(short["data"][0]["embedding"]) == 4
    decoded = struct.unpack(f"<{EMBED_DIM}f", base64.b64decode(coded["data"][0]["embedding"]))
    assert all(
        math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-7)
        for x, y in zip(decoded, vectors[0], strict=True)
    )


async def test_binary_embeddings(session):
    body = {"model": MODEL, "input": ["a", "b c"], "encoding_format": "bytes"}
    async with running_sim(SimConfig()) as sim:
        async with session.post(sim.url + "/v1/embeddings", json=body) as r:
            raw, metadata = await r.read(), orjson.loads(r.headers["metadata"])
            assert r.headers["Content-Type"] == "application/octet-stream"
        only = {**body, "encoding_format": "bytes_only"}
        async with session.post(sim.url + "/v1/embeddings", json=only) as r:
            assert "metadata" not in r.headers and await r.read() == raw
    assert [(i["start"], i["end"], i["shape"]) for i in metadata["data"]] == [
        (0, 4 * EMBED_DIM, [EMBED_DIM]),
        (4 * EMBED_DIM, 8 * EMBED_DIM, [EMBED_DIM]),
    ]
    assert len(raw) == 8 * EMBED_DIM and metadata["usage"]["prompt_tokens"] == 3


async def test_pooling_and_token_level_pooling(session):
    async with running_sim(SimConfig()) as sim:
        _, pooled = await _post(session, sim, "/pooling", {"input": "three little words"})
        _, tokens = await _post(
            session, sim, "/pooling", {"input": "three little words", "task": "token_embed"}
        )
    assert pooled["id"].startswith("pooling-") and pooled["data"][0]["object"] == "pooling"
    assert len(pooled["data"][0]["data"]) == EMBED_DIM
    assert len(tokens["data"][0]["data"]) == 3  # one vector per token
    assert tokens["data"][0]["data"][-1] == pooled["data"][0]["data"]


async def test_score_pairs_like_vllm(session):
    async with running_sim(SimConfig()) as sim:
        _, one_to_many = await _post(
            session, sim, "/score", {"queries": "q", "documents": ["a", "b", "c"]}
        )
        _, pairwise = await _post(
            session, sim, "/v1/score", {"data_1": ["q", "r"], "data_2": ["a", "b"]}
        )
        status, err = await _post(
            session, sim, "/score", {"text_1": ["q", "r"], "text_2": ["a", "b", "c"]}
        )
    assert [d["index"] for d in one_to_many["data"]] == [0, 1, 2]
    assert all(0 < d["score"] < 1 and d["object"] == "score" for d in one_to_many["data"])
    assert one_to_many["id"].startswith("score-") and len(pairwise["data"]) == 2
    assert status == 400 and "1:1, 1:N or N:N" in err["error"]["message"]


async def test_rerank_sorts_and_cuts(session):
    body = {"query": "q", "documents": ["x", "y z", "w"]}
    async with running_sim(SimConfig()) as sim:
        _, everything = await _post(session, sim, "/rerank", body)
        _, top = await _post(session, sim, "/v2/rerank", {**body, "top_n": 1})
    scores = [r["relevance_score"] for r in everything["results"]]
    assert scores == sorted(scores, reverse=True) and len(scores) == 3
    assert top["results"] == everything["results"][:1]
    assert everything["results"][0]["document"] == {
        "text": body["documents"][everything["results"][0]["index"]],
        "multi_modal": None,
    }
    assert set(everything) == {"id", "model", "usage", "results"}


async def test_wrong_model_faults_and_methods(session):
    async with running_sim(SimConfig(faults=Faults(status=503))) as sim:
        status, _ = await _post(session, sim, "/tokenize", {"prompt": "x"})
        assert status == 503
        sim.clear_faults()
        status, err = await _post(session, sim, "/v1/embeddings", {"model": "other", "input": "x"})
        assert status == 404 and err["error"]["message"] == "The model `other` does not exist."
        async with session.get(sim.url + "/v1/embeddings") as r:
            assert r.status == 405
    assert [r.path for r in sim.requests if r.method == "POST"] == ["/tokenize", "/v1/embeddings"]


RESPONSE_FIELDS = [
    "id", "created_at", "incomplete_details", "instructions", "metadata", "model", "object",
    "output", "parallel_tool_calls", "temperature", "tool_choice", "tools", "top_p",
    "background", "max_output_tokens", "max_tool_calls", "previous_response_id", "prompt",
    "reasoning", "service_tier", "status", "text", "top_logprobs", "truncation", "usage",
    "user", "presence_penalty", "frequency_penalty", "kv_transfer_params",
    "ec_transfer_params", "input_messages", "output_messages",
]  # fmt: skip


async def test_responses_whole_answer(session):
    body = {"model": MODEL, "input": "say hi", "instructions": "be brief", "max_output_tokens": 4}
    async with running_sim(SimConfig()) as sim:
        status, data = await _post(session, sim, "/v1/responses", {**body, "request_id": "resp_x"})
        _, longer = await _post(session, sim, "/v1/responses", {**body, "max_output_tokens": 9})
    assert status == 200 and list(data) == RESPONSE_FIELDS
    assert data["id"] == "resp_x" and data["object"] == "response"
    assert data["status"] == "incomplete"  # it stopped at max_output_tokens, as vLLM says
    assert data["incomplete_details"] == {"reason": "max_output_tokens"}
    [message] = data["output"]
    assert message["type"] == "message" and message["status"] == "completed"
    text = message["content"][0]["text"]
    assert len(text.split()) == 4 and longer["output"][0]["content"][0]["text"].startswith(text)
    usage = data["usage"]
    assert usage["output_tokens"] == 4
    assert usage["total_tokens"] == usage["input_tokens"] + 4


async def test_responses_stream_events(session):
    body = {"model": MODEL, "input": "say hi", "max_output_tokens": 3, "stream": True}
    async with (
        running_sim(SimConfig()) as sim,
        session.post(sim.url + "/v1/responses", json=body) as r,
    ):
        assert r.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        raw = await r.read()
    blocks = [b.split("\n", 1) for b in raw.decode().split("\n\n") if b]
    names = [name.removeprefix("event: ") for name, _ in blocks]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 3,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    events = [orjson.loads(data.removeprefix("data: ")) for _, data in blocks]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert all(e["type"] == name for e, name in zip(events, names, strict=True))
    assert all(
        data.endswith(f'"type":"{name}"}}') for (_, data), name in zip(blocks, names, strict=True)
    )
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == deltas
    assert events[0]["response"]["status"] == "in_progress" and "[DONE]" not in raw.decode()


@pytest.mark.parametrize("stored", [False, True])
async def test_previous_response_id_needs_the_store(session, stored):
    async with running_sim(SimConfig(responses_store=stored)) as sim:
        _, first = await _post(
            session, sim, "/v1/responses", {"input": "remember", "max_output_tokens": 2}
        )
        follow = {"input": "and now", "max_output_tokens": 2, "previous_response_id": first["id"]}
        status, data = await _post(session, sim, "/v1/responses", follow)
    if not stored:
        assert status == 404
        assert data["error"] == {
            "message": f"Response with id '{first['id']}' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
        return
    assert status == 200 and data["previous_response_id"] == first["id"]
    assert data["usage"]["input_tokens"] > first["usage"]["input_tokens"] + 2


def test_responses_store_flag():
    assert config_from_args(build_parser().parse_args(["--responses-store"])).responses_store
    assert not config_from_args(build_parser().parse_args([])).responses_store
