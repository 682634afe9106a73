"""Parse OpenAI requests the way vLLM reads them, and render vLLM's response shapes."""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
import pydantic

from engines.sim import model
from engines.sim.errors import ApiError, RequestValidationError
from engines.sim.lora import ServedModels

Kind = Literal["completion", "chat", "generate"]
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
# vLLM's token-in entrypoint (--enable-scale-out): token ids in, sampling_params as an
# object, token ids out (output_mode "tokens").
GENERATE_PATH = "/inference/v1/generate"
KIND_BY_PATH: dict[str, Kind] = {
    COMPLETIONS_PATH: "completion",
    CHAT_PATH: "chat",
    GENERATE_PATH: "generate",
}
# vLLM's request models are pydantic models in lax mode: "true", "yes", 1 are a bool field's
# true, "2" and 2.0 an int field's 2. The sim reads the fields it acts on the same way.
_BOOL = pydantic.TypeAdapter(bool)
_INT = pydantic.TypeAdapter(int)
_ID_PREFIX: dict[Kind, str] = {
    "completion": "cmpl",
    "chat": "chatcmpl",
    "generate": "generate-tokens",
}


@dataclass
class GenRequest:
    """One parsed generation request."""

    kind: Kind
    body: dict[str, Any]
    model: str
    prompt_tokens: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    stop: list[str]
    response_id: str
    internal_id: str
    kv_transfer_params: dict[str, Any] | None
    dp_rank: int | None
    created: int = field(default_factory=lambda: int(time.time()))
    # every generated token, the one that completed a stop string too (vLLM's token_ids)
    output_ids: list[int] = field(default_factory=list)

    @property
    def n(self) -> int:
        """Choices to return (vLLM forks one request per choice; the sim's are identical)."""
        n = self.options.get("n")
        if type(n) is not int:
            n = _lax(_INT, n, 1)
        return n if n > 1 else 1

    @property
    def priority(self) -> int:
        """vLLM's ``priority`` (lower is served sooner under its priority policy)."""
        value = self.body.get("priority")
        if type(value) is not int:
            value = _lax(_INT, value, 0)
        return value

    @property
    def echoed(self) -> str:
        """The prompt a completion with ``echo`` puts before each choice's text."""
        prompt = self.body.get("prompt")
        echo = _lax(_BOOL, self.body.get("echo"), False)
        if self.kind == "completion" and echo and isinstance(prompt, str):
            return prompt
        return ""

    @property
    def options(self) -> dict[str, Any]:
        """Where the sampling options are: a generate body's ``sampling_params``, else the
        body itself."""
        if self.kind == "generate":
            params: dict[str, Any] = self.body["sampling_params"]
            return params
        return self.body


def parse(
    kind: Kind,
    body: dict[str, Any],
    headers: dict[str, str],
    served: ServedModels,
    max_model_len: int,
    dp_size: int,
) -> GenRequest:
    """Validate a request body (see load_json) and headers; raises ApiError like vLLM.

    RequestValidationError marks what vLLM's pydantic schema rejects before its handler runs
    (wrong types, missing fields); any other ApiError is the handler's own answer.
    """
    if _lax(_BOOL, body.get("stream"), False) and _lax(_BOOL, body.get("use_beam_search"), False):
        # vLLM's handler checks this before the model name, tokenization and max_tokens
        raise ApiError(400, "Streaming is not currently supported with beam search")
    name = served.resolve(body.get("model"))  # vLLM's 404 when it serves no such model
    dp_rank = _dp_rank(headers, dp_size)
    tokens = _prompt_tokens(kind, body)
    options = _sampling_params(body) if kind == "generate" else body
    base = headers.get("x-request-id") or str(body.get("request_id") or uuid.uuid4().hex)
    resp_id = f"{_ID_PREFIX[kind]}-{base}"
    suffix = os.urandom(4).hex()
    internal = f"{resp_id}-0-{suffix}" if kind == "completion" else f"{resp_id}-{suffix}"
    stream = _bool(body, "stream")
    _bool(body, "use_beam_search")  # accepted; served as an ordinary request
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise RequestValidationError("stream_options must be an object")
    kvp = body.get("kv_transfer_params")
    if kvp is not None and not isinstance(kvp, dict):
        raise RequestValidationError("kv_transfer_params must be an object")
    return GenRequest(
        kind=kind,
        body=body,
        model=name,
        prompt_tokens=tokens,
        max_tokens=max_tokens(kind, options, len(tokens), max_model_len),
        stream=stream,
        include_usage=stream and bool(_lax(_BOOL, opts.get("include_usage"), False)),
        stop=_stop(options),
        response_id=resp_id,
        internal_id=internal,
        kv_transfer_params=kvp,
        dp_rank=dp_rank,
    )


def load_json(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise RequestValidationError(f"JSON decode error: {exc}") from exc
    if not isinstance(body, dict):
        raise RequestValidationError(
            "Input should be a valid dictionary or object to extract fields from"
        )
    return body


def _dp_rank(headers: dict[str, str], dp_size: int) -> int | None:
    raw = headers.get("x-data-parallel-rank")
    if raw is None:
        return None
    try:
        rank = int(raw)
    except ValueError:
        return None  # vLLM silently ignores a non-int rank
    if not 0 <= rank < dp_size:
        raise ApiError(400, f"data_parallel_rank {rank} is out of range [0, {dp_size}).")
    return rank


def _sampling_params(body: dict[str, Any]) -> dict[str, Any]:
    params = body.get("sampling_params")
    if not isinstance(params, dict):
        raise RequestValidationError("sampling_params: Field required (an object)")
    return params


def _prompt_tokens(kind: Kind, body: dict[str, Any]) -> list[int]:
    if kind == "generate":
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
            raise RequestValidationError("token_ids: a non-empty list of integers is required")
        if any(t < 0 for t in ids):
            raise RequestValidationError("token_ids must not contain negative values")
        return list(ids)
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise RequestValidationError("messages: Field required (a non-empty list)")
        if not messages:
            raise ApiError(400, "messages: Field required (a non-empty list)")
        if not all(isinstance(m, dict) for m in messages):
            raise RequestValidationError("messages: each message must be an object")
        try:
            return model.tokenize(
                model.render_chat(
                    messages,
                    generation_prompt=_lax(_BOOL, body.get("add_generation_prompt"), True),
                    continue_final=_lax(_BOOL, body.get("continue_final_message"), False),
                )
            )
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc
    return _completion_prompt(body.get("prompt"))


def _completion_prompt(prompt: Any) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        tokens = model.tokenize(prompt)
    elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
        tokens = list(prompt)
    elif prompt is None:
        raise RequestValidationError("prompt: Field required")
    else:
        raise RequestValidationError(
            "prompt must be a string, a list of token ids, or one of those in a list"
        )
    if not tokens:
        raise ApiError(400, "The prompt cannot be empty.")
    return tokens


def max_tokens(kind: Kind, body: dict[str, Any], n_prompt: int, max_model_len: int) -> int:
    value = body.get("max_completion_tokens") if kind == "chat" else None
    if value is None:
        value = body.get("max_tokens")
    room = max_model_len - n_prompt
    if room <= 0 or (value is not None and type(value) is int and value > room):
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {n_prompt + (value or 0)} tokens ({n_prompt} in the messages, "
            f"{value or 0} in the completion). Please reduce the length of the messages or "
            "completion.",
        )
    if value is None:
        return room
    if type(value) is not int:
        raise RequestValidationError(f"max_tokens must be at least 1, got {value!r}.")
    if value < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {value!r}.")
    return value


def _bool(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    try:
        return bool(_BOOL.validate_python(value))
    except pydantic.ValidationError:
        raise RequestValidationError(f"{key}: Input should be a valid boolean") from None


def _lax(adapter: pydantic.TypeAdapter[Any], value: Any, default: Any) -> Any:
    """``value`` as vLLM's model reads it; ``default`` when null or refused."""
    if value is None:
        return default
    try:
        return adapter.validate_python(value)
    except pydantic.ValidationError:
        return default


def _stop(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise RequestValidationError("stop must be a string or a list of strings")
