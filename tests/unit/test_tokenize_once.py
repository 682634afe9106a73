"""Tokenize once's pure parts: which requests take the text path, the generate body, and
generate's text answer in vLLM's OpenAI bytes (the bytes captured from vLLM 0.32)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from pdproxy.types import ApiKind
from pdproxy.wire.derender import AnswerContext, StreamTranslator, response_id, whole_answer
from pdproxy.wire.tokenize_once import fallback_reason, generate_body, rendered_request

CHAT, COMPLETIONS = ApiKind.CHAT, ApiKind.COMPLETIONS
FP = "vllm-0.32.0-5e4d3f5f"


@pytest.mark.parametrize(
    ("kind", "extra", "reason"),
    [
        (CHAT, {}, None),
        (COMPLETIONS, {"logprobs": None, "n": 1, "echo": False}, None),
        (COMPLETIONS, {"prompt": [1, 2, 3]}, None),
        (COMPLETIONS, {"prompt": ["one"]}, None),
        (COMPLETIONS, {"prompt": ["one", "two"]}, "prompts"),
        (COMPLETIONS, {"logprobs": 0}, "logprobs"),
        (CHAT, {"top_logprobs": 0}, "logprobs"),
        (CHAT, {"tool_choice": "none"}, "tools"),
        (CHAT, {"best_of": 2}, "parallel_sampling"),
        (COMPLETIONS, {"use_beam_search": True}, "parallel_sampling"),
        (COMPLETIONS, {"prompt_logprobs": 1}, "echo"),
        (CHAT, {"continue_final_message": True}, "chat_role"),
        (CHAT, {"return_token_ids": True}, "unsupported_field"),
        (COMPLETIONS, {"suffix": "x"}, "unsupported_field"),
        (CHAT, {"stream_options": {"continuous_usage_stats": True}}, "continuous_usage"),
        # issue 19 row 7: read as vLLM reads them, not by their JSON type
        (COMPLETIONS, {"n": "2"}, "parallel_sampling"),
        (CHAT, {"n": 2.0}, "parallel_sampling"),
        (COMPLETIONS, {"n": "1"}, None),
        (COMPLETIONS, {"use_beam_search": "true"}, "parallel_sampling"),
        (COMPLETIONS, {"use_beam_search": "false"}, None),
        (COMPLETIONS, {"logprobs": False}, "logprobs"),  # false is 0: logprobs all the same
        (CHAT, {"logprobs": "true"}, "logprobs"),
        (CHAT, {"logprobs": "false"}, None),
        (CHAT, {"logprobs": 0}, None),
        (COMPLETIONS, {"echo": "true"}, "echo"),
        (COMPLETIONS, {"echo": "off"}, None),
        (COMPLETIONS, {"prompt_logprobs": 0}, "echo"),
        (CHAT, {"add_generation_prompt": "false"}, "chat_role"),
        (CHAT, {"continue_final_message": "true"}, "chat_role"),
        (CHAT, {"continue_final_message": "false"}, None),
        (CHAT, {"stream_options": {"continuous_usage_stats": "yes"}}, "continuous_usage"),
        (CHAT, {"stream_options": {"continuous_usage_stats": "no"}}, None),
        (COMPLETIONS, {"prompt": [7] * 1_000_000}, None),  # told by its first id, not walked
    ],
)
def test_fallback_reason(kind, extra, reason):
    body: dict[str, Any] = {"model": "m", "prompt": "p", "messages": [], **extra}
    assert fallback_reason(kind, body) == reason


def test_generate_body_carries_the_render_and_puts_back_a_default_limit():
    rendered = {
        "request_id": "chatcmpl-x",
        "token_ids": [1, 2],
        "features": None,
        "sampling_params": {"temperature": 0.0, "output_kind": 1, "stop": ["\n"]},
        "model": "m",
        "cache_salt": "salt",
        "priority": 0,
        "kv_transfer_params": {"client": "never"},
        "stream": True,
    }
    client = {"stream": True, "stream_options": {"include_usage": True}}
    body = generate_body(client, rendered)
    assert body == {
        "token_ids": [1, 2],
        "model": "m",
        "cache_salt": "salt",
        "priority": 0,
        "sampling_params": {"temperature": 0.0, "stop": ["\n"], "max_tokens": 16},
        "output_mode": "text",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    rendered["sampling_params"] = {"max_tokens": 5}
    assert generate_body({}, rendered)["sampling_params"] == {"max_tokens": 5}


@pytest.mark.parametrize(
    ("stream", "streams"), [("true", True), ("on", True), (1, True), ("false", False)]
)
def test_generate_body_streams_as_vllm_reads_the_clients_stream(stream, streams):
    rendered = {"token_ids": [1], "sampling_params": {}}
    body = generate_body({"stream": stream, "stream_options": {"include_usage": "true"}}, rendered)
    assert body["stream"] is streams
    assert ("stream_options" in body) is streams


def test_rendered_request_takes_one_generate_request():
    one = {"token_ids": [1], "sampling_params": {}}
    assert rendered_request(COMPLETIONS, [one]) == one
    assert rendered_request(COMPLETIONS, [one, one]) is None
    assert rendered_request(CHAT, one) == one
    assert rendered_request(CHAT, {"token_ids": [], "sampling_params": {}}) is None


# generate's answers and the text path's, as vLLM 0.32 wrote them for SmolLM2 on CPU.
_GENERATED = {
    "request_id": "generate-tokens-abc",
    "model": "smol",
    "created": 1796149778,
    "usage": {
        "prompt_tokens": 5,
        "total_tokens": 10,
        "completion_tokens": 5,
        "prompt_tokens_details": {
            "cached_tokens": 0,
            "created_cache_tokens": None,
            "multimodal_tokens": None,
        },
        "completion_tokens_details": None,
    },
    "prompt_logprobs": None,
    "metrics": None,
    "kv_transfer_params": None,
    "ec_transfer_params": None,
    "output_mode": "text",
    "choices": [
        {
            "index": 0,
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": [7042, 30, 198, 198, 504],
            "routed_experts": None,
            "text": " Paris.\n\nThe",
            "logprobs": None,
        }
    ],
}
_COMPLETION = (
    b'{"id":"cmpl-abc","object":"text_completion","created":1796149778,"model":"smol",'
    b'"choices":[{"index":0,"text":" Paris.\\n\\nThe","logprobs":null,"finish_reason":"length",'
    b'"stop_reason":null,"token_ids":null,"prompt_logprobs":null,"prompt_token_ids":null,'
    b'"routed_experts":null}],"service_tier":null,"system_fingerprint":"vllm-0.32.0-5e4d3f5f",'
    b'"usage":{"prompt_tokens":5,"total_tokens":10,"completion_tokens":5,"prompt_tokens_details"'
    b':{"cached_tokens":0,"created_cache_tokens":null,"multimodal_tokens":null},'
    b'"completion_tokens_details":null},"kv_transfer_params":null,"ec_transfer_params":null,'
    b'"metrics":null}'
)


def test_a_whole_completion_is_the_text_paths_bytes():
    ctx = AnswerContext(COMPLETIONS, "smol", FP, transferred=True)
    assert whole_answer(ctx, _GENERATED) == _COMPLETION


def test_a_whole_chat_answer_reports_no_cache_writes_on_a_decode_that_read_the_prompt():
    ctx = AnswerContext(CHAT, "smol", FP, transferred=True)
    answer = orjson.loads(whole_answer(ctx, _GENERATED))
    assert answer["id"] == "chatcmpl-abc" and answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["content"] == " Paris.\n\nThe"
    assert answer["usage"]["prompt_tokens_details"]["created_cache_tokens"] == 0
    alone = AnswerContext(CHAT, "smol", FP, transferred=False)
    details = orjson.loads(whole_answer(alone, _GENERATED))["usage"]["prompt_tokens_details"]
    assert details["created_cache_tokens"] is None  # a decode alone: generate does not say


def _gen_chunk(text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "finish_reason": finish, "stop_reason": None, "token_ids": [1]}
    chunk = {"request_id": "generate-tokens-abc", "usage": None, "output_mode": "text"}
    choice.update(text=text, logprobs=None)
    return b"data: " + orjson.dumps({**chunk, "choices": [choice]}) + b"\n\n"


def test_a_chat_stream_split_anywhere_becomes_vllms_chunks():
    usage = b'data: {"request_id":"generate-tokens-abc","usage":{"prompt_tokens":5,'
    usage += b'"total_tokens":6,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens'
    usage += b'":0}},"output_mode":"text","choices":[]}\n\ndata: [DONE]\n\n'
    stream = _gen_chunk("The") + _gen_chunk("", "stop") + usage
    ctx = AnswerContext(CHAT, "smol", FP, transferred=True, include_usage=True)
    translator = StreamTranslator(ctx, created=7)
    out = b"".join(translator.feed(stream[i : i + 9]) for i in range(0, len(stream), 9))
    head = b'{"id":"chatcmpl-abc","object":"chat.completion.chunk","created":7,"model":"smol",'
    assert out.split(b"\n\n") == [
        b"data: " + head + b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
        b'"logprobs":null,"finish_reason":null}],"prompt_token_ids":null,"prompt_text":null}',
        b"data: " + head + b'"choices":[{"index":0,"delta":{"content":"The"},"logprobs":null,'
        b'"finish_reason":null,"token_ids":null}]}',
        b"data: " + head + b'"choices":[{"index":0,"delta":{"content":""},"logprobs":null,'
        b'"finish_reason":"stop","stop_reason":null,"token_ids":null}]}',
        b"data: " + head + b'"choices":[],"usage":{"prompt_tokens":5,"total_tokens":6,'
        b'"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":0,'
        b'"created_cache_tokens":0}},"system_fingerprint":"vllm-0.32.0-5e4d3f5f"}',
        b"data: [DONE]",
        b"",
    ]


def test_a_stream_without_usage_stamps_the_fingerprint_on_the_last_token_and_errors_pass():
    error = b'data: {"error":{"message":"boom","type":"InternalServerError","code":500}}\n\n'
    ctx = AnswerContext(COMPLETIONS, "smol", FP, transferred=True)
    out = StreamTranslator(ctx, created=7).feed(_gen_chunk(" a", "length") + error)
    last, passed, _ = out.split(b"\n\n")
    assert orjson.loads(last[6:])["system_fingerprint"] == FP
    assert passed + b"\n\n" == error


def test_response_id():
    assert response_id(CHAT, "generate-tokens-x1") == "chatcmpl-x1"
    assert response_id(COMPLETIONS, "other") == "cmpl-other"


def test_render_servers_need_render_once_and_decodes_that_answer_alone():
    from pdproxy.app import create_app
    from pdproxy.config.proxy import ProxyConfig
    from pdproxy.errors import ConfigError
    from pdproxy.types import EngineAddress

    pair = {
        "prefill": (EngineAddress(url="http://127.0.0.1:1"),),
        "decode": (EngineAddress(url="http://127.0.0.1:2"),),
    }
    with pytest.raises(ConfigError, match="--render needs --render-once"):
        ProxyConfig(**pair, render=(EngineAddress(url="http://127.0.0.1:3"),))
    with pytest.raises(ConfigError, match="--render-once needs decodes"):
        create_app(ProxyConfig(**pair, kv_connector="p2p-nccl", render_once=True))
    assert create_app(ProxyConfig(**pair, render_once=True)).state.pdproxy.render_once


async def test_a_decode_that_cannot_be_asked_has_no_fingerprint_for_a_while():
    from engines.ports import free_port
    from pdproxy.config.upstream import PoolLimits, Timeouts
    from pdproxy.proxying.render_once import Fingerprints
    from pdproxy.upstream.engine_client import EngineClient

    now = [100.0]
    client = EngineClient(Timeouts(connect=0.5, read=0.5), PoolLimits())
    await client.start()
    try:
        fingerprints = Fingerprints(client, lambda: now[0])
        nobody = f"http://127.0.0.1:{free_port()}"  # nothing listens: connect refused
        await fingerprints.learn([nobody], "m", None)
        assert fingerprints.known(nobody) and fingerprints.get(nobody) is None
        now[0] += 31  # asked again after 30 s
        assert not fingerprints.known(nobody)
    finally:
        await fingerprints.aclose()
        await client.aclose()
