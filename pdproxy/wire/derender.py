"""A ``/inference/v1/generate`` text answer (``output_mode: "text"``) put into the OpenAI
completion or chat completion shape, byte for byte what vLLM 0.32's OpenAI serving writes
for the same generation (``--render-once``). Pure: no I/O.

What vLLM's text path writes, and where each field comes from here:

* ``id``: ``cmpl-`` / ``chatcmpl-`` + the leg's ``X-Request-Id``, as generate's
  ``generate-tokens-`` + the same; ``created``: the answer's (a stream's: when it starts);
* ``model``: the served name generate reports (a stream has none: the client's, which the
  engine accepted as one of its names);
* ``choices``: generate's text, finish and stop reasons, routed experts; the OpenAI-only
  fields are ``null`` (no tools, no reasoning, no logprobs: those requests take the text
  path, ``tokenize_once.fallback_reason``);
* ``system_fingerprint``: the decode's own, learned once per decode (generate has none);
* ``usage``: generate's; a chat answer's ``prompt_tokens_details.created_cache_tokens`` is
  the decode's local cache writes, which vLLM reports as 0 on a decode that read the prompt
  over the connector (the one figure generate leaves out);
* ``kv_transfer_params``, ``ec_transfer_params``, ``metrics``: generate's.

Whole answers are dumped in the field order of vLLM's pydantic models (all fields, as its
``JSONResponse(model_dump())``); stream chunks with only the fields vLLM sets
(``model_dump_json(exclude_unset=True)``), the usage chunk without its ``null`` ones.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from pdproxy.types import ApiKind
from pdproxy.wire.kv_params import KV_TRANSFER_PARAMS
from pdproxy.wire.shaping import REQUEST_ID

_GENERATE_PREFIX = "generate-tokens-"
_ID_PREFIX = {ApiKind.COMPLETIONS: "cmpl-", ApiKind.CHAT: "chatcmpl-"}
_OBJECT = {ApiKind.COMPLETIONS: "text_completion", ApiKind.CHAT: "chat.completion"}
_CHUNK_OBJECT = {ApiKind.COMPLETIONS: "text_completion", ApiKind.CHAT: "chat.completion.chunk"}
_DONE = b"[DONE]"
_DATA = b"data: "
_EVENT_END = b"\n\n"
ASSISTANT = "assistant"


@dataclass(frozen=True, slots=True)
class AnswerContext:
    """What the OpenAI answer needs besides generate's: the endpoint, the client's model
    name (a stream's), the decode's fingerprint, whether the decode read the prompt over
    the connector (else it computed it alone), and a stream's usage option."""

    kind: ApiKind
    model: str
    fingerprint: str | None
    transferred: bool
    include_usage: bool = False


def response_id(kind: ApiKind, generate_id: Any) -> str:
    """The text path's id for the same leg: its prefix on generate's request id."""
    text = str(generate_id)
    base = text[len(_GENERATE_PREFIX) :] if text.startswith(_GENERATE_PREFIX) else text
    return _ID_PREFIX[kind] + base


def _usage(ctx: AnswerContext, usage: Any) -> Any:
    """generate's usage, with the chat answer's count of the decode's cache writes."""
    if ctx.kind is not ApiKind.CHAT or not isinstance(usage, dict):
        return usage
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict) or details.get("created_cache_tokens") is not None:
        return usage
    if not ctx.transferred:
        return usage  # a decode alone computed the prompt: generate does not say how much
    return {**usage, "prompt_tokens_details": {**details, "created_cache_tokens": 0}}


def _whole_choice(kind: ApiKind, choice: Mapping[str, Any]) -> dict[str, Any]:
    text = choice.get("text", "")
    finish, stop = choice.get("finish_reason") or "stop", choice.get("stop_reason")
    experts = choice.get("routed_experts")
    if kind is ApiKind.COMPLETIONS:
        return {
            "index": choice.get("index", 0),
            "text": text,
            "logprobs": None,
            "finish_reason": finish,
            "stop_reason": stop,
            "token_ids": None,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "routed_experts": experts,
        }
    message = {
        "role": ASSISTANT,
        "content": text,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    return {
        "index": choice.get("index", 0),
        "message": message,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": stop,
        "token_ids": None,
        "routed_experts": experts,
    }


def whole_answer(ctx: AnswerContext, generated: Mapping[str, Any]) -> bytes:
    """The OpenAI answer for generate's whole text answer."""
    kind = ctx.kind
    created = generated.get("created")
    answer: dict[str, Any] = {
        "id": response_id(kind, generated.get(REQUEST_ID)),
        "object": _OBJECT[kind],
        "created": created if isinstance(created, int) else int(time.time()),
        "model": generated.get("model") or ctx.model,
        "choices": [_whole_choice(kind, c) for c in generated.get("choices") or ()],
        "service_tier": None,
        "system_fingerprint": ctx.fingerprint,
        "usage": _usage(ctx, generated.get("usage")),
    }
    if kind is ApiKind.CHAT:
        answer.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
    answer[KV_TRANSFER_PARAMS] = generated.get(KV_TRANSFER_PARAMS)
    answer["ec_transfer_params"] = generated.get("ec_transfer_params")
    answer["metrics"] = generated.get("metrics")
    return orjson.dumps(answer)


class StreamTranslator:
    """generate's SSE stream (``output_mode: "text"``) into vLLM's OpenAI chunks, fed the
    bytes as they arrive; an event split across reads waits for its end. Error events and
    ``[DONE]`` pass as they came (they are the same on both paths)."""

    def __init__(self, ctx: AnswerContext, created: int | None = None) -> None:
        self._ctx = ctx
        self._created = int(time.time()) if created is None else created
        self._pending = b""
        self._role_sent = False

    def feed(self, data: bytes) -> bytes:
        buffered = self._pending + data
        *events, self._pending = buffered.split(_EVENT_END)
        return b"".join(self._event(e) for e in events if e.strip())

    def _event(self, event: bytes) -> bytes:
        payload = event.strip()
        if not payload.startswith(_DATA) or payload[len(_DATA) :] == _DONE:
            return event + _EVENT_END
        try:
            chunk = orjson.loads(payload[len(_DATA) :])
        except orjson.JSONDecodeError:
            return event + _EVENT_END
        if not isinstance(chunk, dict) or "error" in chunk:
            return event + _EVENT_END
        chunk_id = response_id(self._ctx.kind, chunk.get(REQUEST_ID))
        choices = chunk.get("choices") or []
        if not choices:
            return self._usage_chunk(chunk_id, chunk) if chunk.get("usage") else b""
        out = [] if self._role_sent else self._role_chunks(chunk_id, choices)
        out.extend(self._token_chunk(chunk_id, choice) for choice in choices)
        return b"".join(out)

    def _head(self, chunk_id: str) -> dict[str, Any]:
        kind = self._ctx.kind
        return {
            "id": chunk_id,
            "object": _CHUNK_OBJECT[kind],
            "created": self._created,
            "model": self._ctx.model,
        }

    def _role_chunks(self, chunk_id: str, choices: list[Any]) -> list[bytes]:
        """Chat's first chunk announces the assistant's role (completions have none)."""
        self._role_sent = True
        if self._ctx.kind is not ApiKind.CHAT:
            return []
        delta = {"role": ASSISTANT, "content": ""}
        first = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        chunk = {**self._head(chunk_id), "choices": [first]}
        chunk.update(prompt_token_ids=None, prompt_text=None)
        return [_sse(chunk)]

    def _token_chunk(self, chunk_id: str, choice: Mapping[str, Any]) -> bytes:
        finish = choice.get("finish_reason")
        text, stop = choice.get("text", ""), choice.get("stop_reason")
        index = choice.get("index", 0)
        piece: dict[str, Any]
        if self._ctx.kind is ApiKind.COMPLETIONS:
            piece = {"index": index, "text": text, "logprobs": None, "finish_reason": finish}
            piece.update(stop_reason=stop, prompt_token_ids=None, token_ids=None)
        else:
            piece = {"index": index, "delta": {"content": text}, "logprobs": None}
            piece["finish_reason"] = finish
            if finish is not None:
                piece["stop_reason"] = stop
            piece["token_ids"] = None
        chunk = {**self._head(chunk_id), "choices": [piece]}
        ctx = self._ctx
        if finish is not None and not ctx.include_usage and ctx.fingerprint is not None:
            chunk["system_fingerprint"] = ctx.fingerprint
        return _sse(chunk)

    def _usage_chunk(self, chunk_id: str, chunk: Mapping[str, Any]) -> bytes:
        out = {**self._head(chunk_id), "choices": [], "usage": _usage(self._ctx, chunk["usage"])}
        if self._ctx.fingerprint is not None:
            out["system_fingerprint"] = self._ctx.fingerprint
        if chunk.get("metrics") is not None:
            out["metrics"] = chunk["metrics"]
        return _sse(out)


def _sse(chunk: Mapping[str, Any]) -> bytes:
    return _DATA + orjson.dumps(chunk) + _EVENT_END
