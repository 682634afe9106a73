"""vLLM's response bodies and SSE chunks for completions, chat and the token-in generate
(``output_mode`` "tokens": token ids out, no text)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from engines.sim import model
from engines.sim.openai_api import GenRequest

DONE = b"data: [DONE]\n\n"


@dataclass(frozen=True)
class Outcome:
    """What a finished generation produced."""

    text: str
    completion_tokens: int
    finish_reason: str
    stop_reason: str | None
    cached_tokens: int
    kv_transfer_params: dict[str, Any] | None
    created_cache_tokens: int = 0  # full prompt blocks computed and cached here


def usage(req: GenRequest, out: Outcome, whole: bool = True) -> dict[str, Any]:
    """vLLM's usage, as with --enable-prompt-tokens-details: whole answers dump every
    field, stream chunks leave the nulls out; only chat reports the cache writes."""
    n = len(req.prompt_tokens)
    completion = out.completion_tokens * req.n
    details: dict[str, Any] = {"cached_tokens": out.cached_tokens}
    created = out.created_cache_tokens if req.kind == "chat" else None
    if whole or created is not None:
        details["created_cache_tokens"] = created
    if whole:
        details["multimodal_tokens"] = None
    data: dict[str, Any] = {
        "prompt_tokens": n,
        "total_tokens": n + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": details,
    }
    if whole:
        data["completion_tokens_details"] = None
    return data


_MESSAGE_EXTRAS: dict[str, Any] = {
    "refusal": None,
    "annotations": None,
    "audio": None,
    "function_call": None,
    "reasoning": None,
}


# The None fields of vLLM's GenerateResponseBase and GenerateChoiceBase, in their order.
_GENERATE_EXTRAS: dict[str, Any] = {
    "prompt_logprobs": None,
    "prompt_token_id_logprobs": None,
    "prompt_token_ids": None,
    "mm_placeholders": None,
    "metrics": None,
}
_GENERATE_CHOICE_EXTRAS: dict[str, Any] = {
    "routed_experts": None,
    "sampling_mask": None,
    "weight_versions": None,
}


def _text_mode(req: GenRequest) -> bool:
    """generate's ``output_mode: "text"``: the detokenized text beside the token ids."""
    return req.kind == "generate" and req.body.get("output_mode") == "text"


def _output_mode(req: GenRequest) -> str:
    return "text" if _text_mode(req) else "tokens"


def _generate_choice(
    req: GenRequest,
    text: str,
    finish: str | None,
    stop_reason: str | None,
    ids: list[int] | None = None,
) -> dict[str, Any]:
    choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": finish,
        "stop_reason": stop_reason,
        "token_ids": model.tokenize(text) if ids is None else ids,
        **_GENERATE_CHOICE_EXTRAS,
    }
    if _text_mode(req):
        choice["text"] = text
    choice["logprobs"] = None
    return choice


def _generate_body(req: GenRequest, out: Outcome) -> bytes:
    data: dict[str, Any] = {
        "request_id": req.response_id,
        "model": req.model,
        "created": req.created,
        "usage": usage(req, out),
        **_GENERATE_EXTRAS,
        "kv_transfer_params": out.kv_transfer_params,
        "ec_transfer_params": None,
        "output_mode": _output_mode(req),
        "choices": [
            _generate_choice(req, out.text, out.finish_reason, out.stop_reason, _all_ids(req))
        ],
    }
    return orjson.dumps(data)


def _all_ids(req: GenRequest) -> list[int] | None:
    """Every generated token's id: a matched stop string leaves the text, not token_ids."""
    return list(req.output_ids) if req.output_ids else None


def _last_ids(req: GenRequest, stop_reason: str | None) -> list[int] | None:
    """A stream's last chunk: the token that completed a stop string stays in token_ids."""
    if isinstance(stop_reason, str) and req.output_ids:
        return req.output_ids[-1:]
    return None


def _generate_chunk(req: GenRequest, choices: list[dict[str, Any]], **extra: Any) -> bytes:
    mode = _output_mode(req)
    data = {"request_id": req.response_id, **extra, "output_mode": mode, "choices": choices}
    return b"data: " + orjson.dumps(data) + b"\n\n"


def full_body(req: GenRequest, out: Outcome) -> bytes:
    """The non-streaming response."""
    if req.kind == "generate":
        return _generate_body(req, out)
    ends: dict[str, Any] = {
        "logprobs": None,
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
    }
    if req.kind == "completion":
        text = req.echoed + out.text
        choice: dict[str, Any] = {"index": 0, "text": text, **ends, "token_ids": None}
        choice.update(prompt_logprobs=None, prompt_token_ids=None, routed_experts=None)
        obj = "text_completion"
    else:
        message = {"role": "assistant", "content": out.text, **_MESSAGE_EXTRAS}
        choice = {"index": 0, "message": message, **ends, "token_ids": None}
        choice["routed_experts"] = None
        obj = "chat.completion"
    data: dict[str, Any] = {
        "id": req.response_id,
        "object": obj,
        "created": req.created,
        "model": req.model,
        "choices": [{**choice, "index": i} for i in range(req.n)],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage(req, out),
    }
    if req.kind == "chat":  # chat has them top-level, completions per choice
        data.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
    data["kv_transfer_params"] = out.kv_transfer_params
    data.update(ec_transfer_params=None, metrics=None)
    return orjson.dumps(data)


def _chunk(req: GenRequest, choices: list[dict[str, Any]], **extra: Any) -> bytes:
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    data = {
        "id": req.response_id,
        "object": obj,
        "created": req.created,
        "model": req.model,
        "choices": choices,
        **extra,
    }
    return b"data: " + orjson.dumps(data) + b"\n\n"


def role_chunk(req: GenRequest) -> bytes:
    """Chat's first chunk, announcing the assistant role (completions have none)."""
    delta = {"role": "assistant", "content": ""}
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
    return _each_choice(req, [choice], prompt_token_ids=None, prompt_text=None)


def _each_choice(req: GenRequest, choices: list[dict[str, Any]], **extra: Any) -> bytes:
    """One chunk per choice index, as vLLM streams ``n`` > 1."""
    return b"".join(
        _chunk(req, [{**c, "index": i} for c in choices], **extra) for i in range(req.n)
    )


def token_chunk(
    req: GenRequest,
    text: str,
    finish: str | None = None,
    stop_reason: str | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
) -> bytes:
    """One streamed token; the last one carries finish_reason (and P's kv_transfer_params,
    except on generate, whose stream has no field for them)."""
    if req.kind == "generate":
        choices = [_generate_choice(req, text, finish, stop_reason, _last_ids(req, stop_reason))]
        return _generate_chunk(req, choices, usage=None)
    if req.kind == "completion":
        choice: dict[str, Any] = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": stop_reason,
            "prompt_token_ids": None,
            "token_ids": None,
        }
    else:
        choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        choice["token_ids"] = None
    if finish is not None and kv_transfer_params is not None:
        return _each_choice(req, [choice], kv_transfer_params=kv_transfer_params)
    return _each_choice(req, [choice])


def usage_chunk(req: GenRequest, out: Outcome) -> bytes:
    """The final `choices: []` chunk sent when stream_options.include_usage is set."""
    if req.kind == "generate":
        return _generate_chunk(req, [], usage=usage(req, out, whole=False))
    return _chunk(req, [], usage=usage(req, out, whole=False))


def stream_all(req: GenRequest, pieces: list[str], out: Outcome) -> bytes:
    """A whole SSE body at once (used when the engine needs no delays)."""
    parts = [role_chunk(req)] if req.kind == "chat" else []
    last = len(pieces) - 1
    for i, piece in enumerate(pieces):
        if i == last:
            parts.append(
                token_chunk(req, piece, out.finish_reason, out.stop_reason, out.kv_transfer_params)
            )
        else:
            parts.append(token_chunk(req, piece))
    if req.include_usage:
        parts.append(usage_chunk(req, out))
    parts.append(DONE)
    return b"".join(parts)
