"""vLLM's render endpoints (``--enable-scale-out``): a text request turned into the body
``/inference/v1/generate`` takes, with vLLM 0.32's shapes.

``/v1/chat/completions/render`` answers one ``GenerateRequest``; ``/v1/completions/render``
a list of them, one per prompt. As in vLLM, the rendered ``sampling_params`` carry the
request's sampling options and the limit the serving layer computed (the client's
``max_completion_tokens`` / ``max_tokens``, else the room left in the context), serialized
as vLLM serializes ``SamplingParams``: without the fields at their default, so a limit of
16 (``max_tokens``' default) is left out and a caller must put it back.
"""

from __future__ import annotations

from typing import Any

import orjson

from engines.sim import model, openai_api
from engines.sim.config import SimConfig
from engines.sim.errors import ApiError, RequestValidationError
from engines.sim.openai_api import Kind
from engines.sim.pooling import Answer, Handler, _base_id, _chat_text, _check_model

# The OpenAI fields that become SamplingParams fields of the same name.
_SAMPLING_KEYS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "logprobs",
)


_DEFAULT_MAX_TOKENS = 16  # SamplingParams' default: left out when serialized


def _sampling_params(body: dict[str, Any], max_tokens: int) -> dict[str, Any]:
    params: dict[str, Any] = {"n": 1, "temperature": 1.0, "top_p": 1.0}
    params.update({k: body[k] for k in _SAMPLING_KEYS if body.get(k) is not None})
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    if max_tokens != _DEFAULT_MAX_TOKENS:
        params["max_tokens"] = max_tokens
    return params


def _generate_request(
    request_id: str, tokens: list[int], body: dict[str, Any], cfg: SimConfig
) -> dict[str, Any]:
    kind: Kind = "chat" if "messages" in body else "completion"
    max_tokens = openai_api.max_tokens(kind, body, len(tokens), cfg.max_model_len)
    stream = bool(body.get("stream"))
    return {
        "request_id": request_id,
        "token_ids": tokens,
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": _sampling_params(body, max_tokens),
        "model": body.get("model", cfg.model),
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": stream,
        "stream_options": body.get("stream_options") if stream else None,
        "cache_salt": body.get("cache_salt"),
        "priority": body.get("priority", 0),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


def render_chat(body: dict[str, Any], headers: dict[str, str], cfg: SimConfig) -> Answer:
    _check_model(body, cfg)
    tokens = model.remember(model.words(_chat_text(body.get("messages"), body)))
    if not tokens:
        raise ApiError(400, "The prompt cannot be empty.")
    request_id = f"chatcmpl-{_base_id(body, headers)}"
    return Answer(orjson.dumps(_generate_request(request_id, tokens, body, cfg)))


def render_completion(body: dict[str, Any], headers: dict[str, str], cfg: SimConfig) -> Answer:
    _check_model(body, cfg)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and type(prompt[0]) is int):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise RequestValidationError("prompt: Field required")
    prompts = [_tokens(p) for p in prompt]
    base = f"cmpl-{_base_id(body, headers)}"
    requests = [
        _generate_request(base if len(prompts) == 1 else f"{base}-{i}", tokens, body, cfg)
        for i, tokens in enumerate(prompts)
    ]
    return Answer(orjson.dumps(requests))


def _tokens(prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        tokens = model.remember(model.words(prompt))
    elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
        tokens = list(prompt)
    else:
        raise RequestValidationError("prompt must be a string or a list of token ids")
    if not tokens:
        raise ApiError(400, "The prompt cannot be empty.")
    return tokens


HANDLERS: dict[str, Handler] = {
    "/v1/chat/completions/render": render_chat,
    "/v1/completions/render": render_completion,
}
