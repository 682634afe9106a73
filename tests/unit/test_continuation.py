"""A cut stream's continuation in pure formats (pdproxy/wire/continuation.py)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from pdproxy.types import ApiKind
from pdproxy.wire.continuation import (
    Generated,
    Rewriter,
    continuation_body,
    continued_seed,
    not_migratable,
    read_generated,
    remaining,
)

COMPLETIONS, CHAT, GENERATE = ApiKind.COMPLETIONS, ApiKind.CHAT, ApiKind.GENERATE


def sse(*events: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)


def text_event(text: str, finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "cmpl-1",
        "created": 7,
        "model": "m",
        "choices": [{"index": 0, "text": text, "finish_reason": finish}],
    }


def chat_event(delta: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "created": 7,
        "model": "m",
        "choices": [{"index": 0, "delta": delta}],
    }


@pytest.mark.parametrize(
    ("kind", "body", "why"),
    [
        (COMPLETIONS, {"prompt": "hi"}, None),
        (COMPLETIONS, {"prompt": ["hi"]}, None),
        (COMPLETIONS, {"prompt": [1, 2]}, "prompt"),
        (COMPLETIONS, {"prompt": "hi", "n": 2}, "n"),
        (COMPLETIONS, {"prompt": "hi", "logprobs": 0}, "logprobs"),
        (COMPLETIONS, {"prompt": "hi", "echo": True}, "echo"),
        (COMPLETIONS, {"prompt": "hi", "prompt_logprobs": 1}, "logprobs"),
        (CHAT, {"messages": [], "logprobs": True}, "logprobs"),
        (CHAT, {"messages": [], "response_format": {"type": "json_object"}}, "structured_output"),
        (CHAT, {"messages": [], "response_format": {"type": "text"}}, None),
        (CHAT, {"messages": [], "tools": [{"type": "function"}]}, "tools"),
        (GENERATE, {"token_ids": [1], "sampling_params": {"n": 3}}, "n"),
        (
            GENERATE,
            {"token_ids": [1], "sampling_params": {"structured_outputs": {}}},
            "structured_output",
        ),
        (GENERATE, {"token_ids": [1], "sampling_params": {"temperature": 0}}, None),
    ],
)
def test_what_cannot_continue_exactly_is_not_migrated(kind, body, why):
    assert not_migratable(kind, body) == why


def test_read_generated_counts_one_token_per_chunk_with_text_and_keeps_the_identity():
    got = read_generated(COMPLETIONS, sse(text_event(" a"), text_event(""), text_event(" b")))
    assert got is not None
    assert (got.whole_text(), got.tokens) == (" a b", 2)
    assert got.identity == {"id": "cmpl-1", "created": 7, "model": "m"}


def test_read_generated_skips_the_role_chunk_and_refuses_tool_calls():
    role = chat_event({"role": "assistant", "content": ""})
    got = read_generated(CHAT, sse(role, chat_event({"content": " x"})))
    assert got is not None and (got.whole_text(), got.tokens) == (" x", 1)
    assert read_generated(CHAT, sse(role, chat_event({"tool_calls": [{}]}))) is None


def test_read_generated_token_in_counts_ids():
    event = {"request_id": "r", "choices": [{"index": 0, "token_ids": [5, 6]}]}
    got = read_generated(GENERATE, sse(event, event))
    assert got is not None and got.token_ids == [5, 6, 5, 6] and got.tokens == 4


@pytest.mark.parametrize(
    "stream",
    [
        sse(text_event(" a"))[:-5],  # cut inside an event
        sse(text_event(" a", finish="length")),  # finished: only its end was lost
        sse(text_event(" a")) + b'data: {"error": {"message": "x"}}\n\n',
        sse(text_event(" a")) + b"data: [DONE]\n\n",
    ],
)
def test_a_stream_that_cannot_be_continued_reads_as_none(stream):
    assert read_generated(COMPLETIONS, stream) is None


def test_completions_continue_the_prompt_text_with_limits_shrunk_and_a_derived_seed():
    body = {"prompt": ["hi"], "max_tokens": 10, "min_tokens": 4, "seed": 3, "stream": True}
    out = continuation_body(COMPLETIONS, body, Generated(text=" a b c", tokens=3))
    assert out["prompt"] == ["hi a b c"]
    assert (out["max_tokens"], out["min_tokens"]) == (7, 1)
    assert out["seed"] == continued_seed(3, 3) != 3
    assert body["prompt"] == ["hi"] and body["max_tokens"] == 10  # never mutated


def test_chat_continues_the_assistant_message():
    body = {"messages": [{"role": "user", "content": "q"}], "max_completion_tokens": 5}
    out = continuation_body(CHAT, body, Generated(text=" a", tokens=1))
    assert out["messages"][-1] == {"role": "assistant", "content": " a"}
    assert out["continue_final_message"] is True and out["add_generation_prompt"] is False
    assert out["max_completion_tokens"] == 4
    again = continuation_body(CHAT, out, Generated(text=" b", tokens=1))
    assert again["messages"][-1] == {"role": "assistant", "content": " a b"}
    assert len(again["messages"]) == 2


def test_token_in_continues_with_the_generated_ids():
    body = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 8, "seed": 1}}
    out = continuation_body(GENERATE, body, Generated(token_ids=[9, 8], tokens=2))
    assert out["token_ids"] == [1, 2, 9, 8]
    assert out["sampling_params"]["max_tokens"] == 6
    assert out["sampling_params"]["seed"] == continued_seed(1, 2)
    assert remaining(GENERATE, body, 2) == 6 and remaining(CHAT, {}, 2) is None


def test_the_rewriter_gives_the_original_identity_drops_the_role_and_carries_usage():
    rewrite = Rewriter({"id": "chatcmpl-1", "created": 7, "model": "m"}, carried=3)
    cont = {"id": "chatcmpl-2", "created": 9, "model": "m"}
    role = {**cont, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    token = {**cont, "choices": [{"index": 0, "delta": {"content": " z"}}]}
    usage = {**cont, "choices": [], "usage": {"prompt_tokens": 13, "completion_tokens": 2}}
    raw = sse(role, token, usage) + b"data: [DONE]\n\n"
    out = rewrite(raw[:50]) + rewrite(raw[50:])  # an event split across chunks
    events = [e[6:] for e in out.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    parsed = [orjson.loads(e) for e in events[:-1]]
    assert len(parsed) == 2  # the role chunk is gone
    assert {(p["id"], p["created"]) for p in parsed} == {("chatcmpl-1", 7)}
    assert parsed[1]["usage"] == {"prompt_tokens": 10, "completion_tokens": 5}


def test_several_tokens_a_chunk_are_counted_from_the_engines_usage():
    # Issue 29: vLLM packs several tokens into one chunk under load or speculative
    # decoding; counted one a chunk, 9 tokens in 3 chunks made a continuation ask for 17
    # tokens instead of 11 (of 20), and usage said 6 where 12 were delivered.
    def counted(text: str, n: int) -> dict[str, Any]:
        usage = {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": 4 + n}
        return {**text_event(text), "usage": usage}

    first = read_generated(COMPLETIONS, sse(counted(" a b c", 3), counted(" d e f", 6)))
    rest = read_generated(COMPLETIONS, sse(counted(" g h i", 9)))
    assert first is not None and rest is not None
    first.extend(rest)  # a fold, then the rest of the same leg
    assert (first.tokens, first.count()) == (3, 9)
    total = Generated()
    total.add_leg(first)
    assert total.tokens == 9 and total.whole_text() == " a b c d e f g h i"
    body = {"prompt": "p", "max_tokens": 20, "stream": True}
    assert continuation_body(COMPLETIONS, body, total)["max_tokens"] == 11
    second = read_generated(COMPLETIONS, sse(counted(" j", 2)))
    assert second is not None
    total.add_leg(second)
    assert total.tokens == 11  # legs add up
    # without the engine's counts, a chunk is the best word there is
    plain = read_generated(COMPLETIONS, sse(text_event(" x y")))
    assert plain is not None and plain.count() == 1


def test_the_rewriter_holds_an_endless_event_without_joining_it_again():
    rewrite = Rewriter({"id": "c"}, carried=0)
    assert rewrite(b"data: {") == b""
    for _ in range(1000):
        assert rewrite(b"x" * 1000) == b""
    assert len(rewrite._partial) == 1001  # kept as pieces, never joined per chunk
    out = rewrite(b'"}\n\n')
    assert out.endswith(b"\n\n") and rewrite._partial == []
