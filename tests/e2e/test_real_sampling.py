"""Every sampling option through pdproxy's two legs, on a real NIXL pair (issue 13, item 4).

Each case sends one request through pdproxy and the same request to the decode engine alone
(its own ``cache_salt``, so nothing the transfer left in the decode's prefix cache stands in
for the reference) and wants the same answer at temperature 0 (``seed`` with a fixed seed).
The pair serves SmolLM2-135M-Instruct, so tool calls, JSON schema and multi-turn answers
are real ones.

Each case also checks *how* pdproxy served it: through both legs, with the prompt's KV
moved from the prefill (the decode's ``external_kv_transfer`` tokens grow by the prompt), or,
for what vLLM 0.32 cannot split across two legs, by the decode alone with its reason counted
(``parallel_sampling`` for ``n``/``best_of`` > 1, ``prompt_logprobs`` for prompt logprobs and
``echo`` with logprobs; ``pdproxy.scheduling.features`` says why).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest

from tests.e2e.conftest import external_tokens, post
from tests.e2e.test_real_nixl import isolated, proxy_config
from tests.servers import running_proxy

pytestmark = pytest.mark.real_engine

QUESTION = "What is the capital of France?"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
TWO_LEGS = None  # served through both legs, the KV moved
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CITY_SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "capital",
        "schema": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
            "required": ["city", "country"],
        },
    },
}


# the session's SmolLM2 tools pair (tests/e2e/conftest.py) has a tool-call parser: vLLM refuses
# ``tool_choice`` other than "none" without one, and builds none without
# ``--enable-auto-tool-choice`` (``pythonic`` needs no special tokens; with "required" vLLM
# constrains the output to a JSON list of calls itself).


@dataclass(frozen=True)
class Case:
    path: str
    fields: dict[str, Any]
    served: str | None = TWO_LEGS  # the decode-only reason, or TWO_LEGS
    check: Any = None  # an extra check of the answer's (normalized) choices
    extra: dict[str, Any] = field(default_factory=dict)


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _two(choices: list[dict]) -> None:
    assert len(choices) == 2 and all(c["text"] for c in choices)


def _has_logprobs(choices: list[dict]) -> None:
    assert choices[0]["logprobs"]["top_logprobs"][0], choices


def _has_chat_logprobs(choices: list[dict]) -> None:
    content = choices[0]["logprobs"]["content"]
    assert content and len(content[0]["top_logprobs"]) == 3, choices


def _has_prompt_logprobs(answer: dict) -> None:
    prompt = answer["choices"][0]["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == answer["usage"]["prompt_tokens"]


def _stopped(choices: list[dict]) -> None:
    assert "Paris" not in choices[0]["message"]["content"]
    assert choices[0]["finish_reason"] == "stop"


def _json(choices: list[dict]) -> None:
    data = orjson.loads(choices[0]["message"]["content"])
    assert set(data) >= {"city", "country"}, data


def _tool_call(choices: list[dict]) -> None:
    calls = choices[0]["message"]["tool_calls"]
    assert calls and calls[0]["function"]["name"] == "get_weather", choices
    assert "city" in orjson.loads(calls[0]["function"]["arguments"])


def _echoed(prompt: str):
    def check(choices: list[dict]) -> None:
        assert choices[0]["text"].startswith(prompt)

    return check


ECHO_PROMPT = "The three primary colors are"
SEEDED = {"temperature": 0.8, "seed": 7}
# fmt: off
CASES = {
    # vLLM 0.32 refuses n > 1 with greedy sampling: a seed makes the choices reproducible
    "n2": Case(COMPLETIONS, {"prompt": ECHO_PROMPT, "n": 2, **SEEDED}, "parallel_sampling",
               _two),
    "n2-stream": Case(
        COMPLETIONS, {"prompt": ECHO_PROMPT, "n": 2, "stream": True, **SEEDED},
        "parallel_sampling", _two,
    ),
    "best_of": Case(COMPLETIONS, {"prompt": ECHO_PROMPT, "best_of": 2}, "parallel_sampling"),
    "logprobs": Case(COMPLETIONS, {"prompt": ECHO_PROMPT, "logprobs": 3}, TWO_LEGS, _has_logprobs),
    "top_logprobs": Case(
        CHAT, {"messages": _user(QUESTION), "logprobs": True, "top_logprobs": 3}, TWO_LEGS,
        _has_chat_logprobs,
    ),
    "prompt_logprobs": Case(
        COMPLETIONS, {"prompt": ECHO_PROMPT, "prompt_logprobs": 2}, "prompt_logprobs",
        extra={"answer_check": _has_prompt_logprobs},
    ),
    "echo": Case(
        COMPLETIONS, {"prompt": ECHO_PROMPT, "echo": True}, TWO_LEGS, _echoed(ECHO_PROMPT)
    ),
    "echo-logprobs": Case(
        COMPLETIONS, {"prompt": ECHO_PROMPT, "echo": True, "logprobs": 1}, "prompt_logprobs",
        _echoed(ECHO_PROMPT),
    ),
    "stop": Case(CHAT, {"messages": _user(QUESTION), "stop": ["Paris"]}, TWO_LEGS, _stopped),
    "min_tokens": Case(
        CHAT, {"messages": _user(QUESTION), "min_tokens": 24, "max_tokens": 28}, TWO_LEGS,
        extra={"usage_at_least": 24},
    ),
    "ignore_eos": Case(
        CHAT, {"messages": _user(QUESTION), "ignore_eos": True, "max_tokens": 40}, TWO_LEGS,
        extra={"usage_at_least": 40},
    ),
    "seed": Case(
        COMPLETIONS, {"prompt": ECHO_PROMPT, "temperature": 0.9, "seed": 1234}, TWO_LEGS
    ),
    "response_format": Case(
        CHAT,
        {"messages": _user(QUESTION + " Answer in JSON."), "response_format": CITY_SCHEMA,
         "max_tokens": 48},
        TWO_LEGS, _json,
    ),
    "tool_calls": Case(
        CHAT,
        {"messages": _user("What is the weather like in Paris?"), "tools": [WEATHER_TOOL],
         "tool_choice": "required", "max_tokens": 48},
        TWO_LEGS, _tool_call,
    ),
    "multi_turn": Case(
        CHAT,
        {"messages": [
            {"role": "system", "content": "You are a helpful geography assistant."},
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "The capital of France is Paris."},
            {"role": "user", "content": "And what is the capital of Italy?"},
        ]},
        TWO_LEGS,
    ),
    "stream_options": Case(
        CHAT,
        {"messages": _user(QUESTION), "stream": True,
         "stream_options": {"include_usage": True}},
        TWO_LEGS, extra={"stream_usage": True},
    ),
    "content_parts": Case(
        CHAT,
        {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is the capital"},
            {"type": "text", "text": " of France?"},
        ]}]},
        TWO_LEGS,
    ),
}
# fmt: on


def _request(pair, case: Case) -> dict[str, Any]:
    return {"model": pair.model, "max_tokens": 16, "temperature": 0, **case.fields}


def _without_ids(value: Any) -> Any:
    """The answer without what differs per request (tool-call ids)."""
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if k != "id"}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


def _streamed(raw: bytes, chat: bool) -> tuple[list[dict], dict | None]:
    """A stream folded into whole choices (text and finish reason per index), and its usage."""
    choices: dict[int, dict] = {}
    usage = None
    for line in raw.split(b"\n"):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = orjson.loads(line[6:])
        usage = chunk.get("usage") or usage
        for c in chunk.get("choices", []):
            whole = choices.setdefault(c["index"], {"text": "", "finish_reason": None})
            piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
            whole["text"] += piece or ""
            whole["finish_reason"] = c.get("finish_reason") or whole["finish_reason"]
    return [choices[i] for i in sorted(choices)], usage


def _whole(answer: dict, chat: bool) -> list[dict]:
    if not chat:
        return answer["choices"]
    return [
        {**c, "text": c["message"].get("content") or ""} for c in answer["choices"]
    ]  # the text under one name, as a folded stream has it


def _close(a: Any, b: Any, path: str = "") -> None:
    """Equal, floats (log probabilities) within 1e-3: the transferred KV was computed by
    another engine process, the same kernels in another order."""
    if isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, abs_tol=1e-3) or a == b, (path, a, b)
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), (path, a.keys() ^ b.keys())
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), (path, len(a), len(b))
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _close(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


async def _decode_only_count(proxy_url: str, reason: str) -> float:
    async with aiohttp.ClientSession() as s, s.get(proxy_url + "/metrics") as r:
        text = await r.text()
    pattern = rf'^pdproxy_decode_only_requests_total\{{reason="{reason}"\}} (\S+)$'
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@pytest.mark.parametrize("name", list(CASES))
async def test_option_through_two_legs_equals_single_engine(smollm2_tools, name):
    pair, case = smollm2_tools, CASES[name]
    chat, stream = case.path == CHAT, case.fields.get("stream") is True
    request = isolated(_request(pair, case))
    before = external_tokens(pair)
    async with running_proxy(proxy_config(pair)) as proxy:
        reason = case.served or "none"
        counted = await _decode_only_count(proxy.url, reason)
        status, raw = await post(proxy.url, case.path, request)
        assert status == 200, raw
        counted = await _decode_only_count(proxy.url, reason) - counted
    moved = external_tokens(pair) - before
    plain = {k: v for k, v in _request(pair, case).items() if k != "stream_options"}
    ref_status, ref_raw = await post(
        pair.decode_url, case.path, isolated({**plain, "stream": False})
    )
    assert ref_status == 200, ref_raw
    reference = orjson.loads(ref_raw)
    expected = _without_ids(_whole(reference, chat))
    if stream:
        got, usage = _streamed(raw, chat)
        _close(got, [{"text": c["text"], "finish_reason": c["finish_reason"]} for c in expected])
        if case.extra.get("stream_usage"):
            assert usage is not None, "include_usage: the last chunk carries the usage"
            assert usage["completion_tokens"] == reference["usage"]["completion_tokens"]
            assert usage["prompt_tokens"] == reference["usage"]["prompt_tokens"]
    else:
        answer = orjson.loads(raw)
        got = _without_ids(_whole(answer, chat))
        _close(got, expected)
        if "answer_check" in case.extra:
            case.extra["answer_check"](answer)
        if "usage_at_least" in case.extra:
            assert answer["usage"]["completion_tokens"] >= case.extra["usage_at_least"]
    if case.check is not None:
        case.check(got)
    prompt_tokens = reference["usage"]["prompt_tokens"]
    if case.served is TWO_LEGS:
        assert prompt_tokens - 1 <= moved <= prompt_tokens, (moved, prompt_tokens)
    else:
        assert counted == 1 and moved == 0, (case.served, counted, moved)
