"""The first token from the prefill (``--first-token-from-prefill``): which token-in streams
may take it, the stream chunk vLLM's decode would have sent for it, and the decode's body
that continues after it. Pure: no I/O.

In PD the prefill has sampled the first token ``t1`` when it answers. A ``/inference/v1/generate``
stream whose answer does not depend on where ``t1`` was sampled gets ``t1`` at once, in the
exact chunk vLLM 0.32's generate stream writes (``serve_tokens_stream_generator``: the model's
fields in order, ``prompt_token_ids``/``mm_placeholders``/``metrics`` left out when null), and
the decode continues from prompt ids + ``[t1]`` with ``max_tokens`` and ``min_tokens`` one
lower; its usage is put back to the original prompt and all completion tokens.

What keeps a stream on the usual path (``reason``): anything whose answer reads the output
from its first token (``n`` > 1, logprobs, prompt logprobs, presence/frequency penalties,
bad words, structured output, stop strings unless ``t1`` ends the request), what reports
the prompt (``return_token_ids``, per-chunk usage), multimodal features and prompt truncation.

The block-size edge (``BlockSizes``): a decode given prompt ids + ``[t1]`` allocates
``ceil((N + 1) / B)`` blocks and reads them from the prefill's ``remote_block_ids``, which
cover ``ceil(N / B)``; when ``N`` is a multiple of ``B`` the decode has one block more than
the prefill lists, and vLLM 0.32's NIXL worker asserts (``_apply_prefix_caching``) and the
decode engine dies. The block size is learned from the prefills' answers (``N`` prompt
tokens held in ``k`` blocks bound ``B``), and a request on the edge, or that might be while
``B`` is not known closely enough, takes the usual path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from pdproxy.wire.coerce import read_bool, read_int
from pdproxy.wire.kv_params import KV_TRANSFER_PARAMS, REMOTE_BLOCK_IDS, REMOTE_ENGINE_ID
from pdproxy.wire.shaping import (
    MAX_TOKENS,
    MIN_TOKENS,
    REQUEST_ID,
    SAMPLING_PARAMS,
    STREAM_OPTIONS,
    TOKEN_IDS,
    JSONBody,
    is_streaming,
    is_token_in,
)

_OFF: tuple[Any, ...] = (None, False, 0, 0.0, [], {}, "")
# SamplingParams whose answer reads the output from its first token on: set at all (a
# logprobs of 0 still returns the sampled token's), or set to something not off.
_SET_BOUND = ("logprobs", "prompt_logprobs", "truncate_prompt_tokens")
_ON_BOUND = (
    "presence_penalty",
    "frequency_penalty",
    "bad_words",
    "structured_outputs",
    "guided_decoding",
)
_USAGE_MARK = b'"usage":{'
_MAX_SOURCES = 1024  # prefill engines whose block size is tracked
_REPLACEMENT = "\ufffd"  # an incomplete UTF-8 sequence: its stream chunk would differ


def reason(body: Mapping[str, Any]) -> str | None:
    """Why ``body`` keeps the usual path (a label), or None when it may take ``t1``."""
    if not is_token_in(body) or not is_streaming(body):
        return "not_token_in_stream"
    params: Mapping[str, Any] = body[SAMPLING_PARAMS]
    if read_int(params.get("n"), 1) != 1 or read_int(params.get("best_of"), 1) > 1:
        return "parallel_sampling"
    if any(params.get(key) is not None for key in _SET_BOUND):
        return "output_bound"
    if any(params.get(key) not in _OFF for key in _ON_BOUND):
        return "output_bound"
    if read_bool(body.get("return_token_ids")) or body.get("features") not in _OFF:
        return "prompt_reported"
    options = body.get(STREAM_OPTIONS)
    if isinstance(options, Mapping) and read_bool(options.get("continuous_usage_stats")):
        return "continuous_usage"
    limits = (params.get(MAX_TOKENS), params.get(MIN_TOKENS))
    if any(v is not None and (type(v) is not int or v < 0) for v in limits):
        return "limits"
    return None


def has_stop_strings(body: Mapping[str, Any]) -> bool:
    """A stop string may span ``t1`` and the next tokens: only a ``t1`` that ends the
    request is exact then (the decode checks its own output only)."""
    return body[SAMPLING_PARAMS].get("stop") not in _OFF


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The prefill's sampled token and what its answer says about it."""

    request_id: str
    token: int
    finish_reason: str | None  # "stop" (EOS, stop string or token); None: the decode goes on
    stop_reason: Any
    text: str | None  # output_mode "text"
    usage: Any


def first_token(body: Mapping[str, Any], answer: Mapping[str, Any]) -> FirstToken | None:
    """``t1`` from the prefill's whole generate answer, or None if it is not one token in
    vLLM's shape (the usual path then)."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    ids, finish = choice.get(TOKEN_IDS), choice.get("finish_reason")
    if not isinstance(ids, list) or len(ids) != 1 or type(ids[0]) is not int:
        return None
    text = choice.get("text")
    if text is not None and (not isinstance(text, str) or text.endswith(_REPLACEMENT)):
        return None
    if finish == "length":
        limit = body[SAMPLING_PARAMS].get(MAX_TOKENS)
        finish = "length" if limit == 1 else None  # only the prefill's clamp ended it
    elif finish != "stop":
        return None
    request_id = answer.get(REQUEST_ID)
    if not isinstance(request_id, str):
        return None
    stop = choice.get("stop_reason")
    return FirstToken(request_id, ids[0], finish, stop, text, answer.get("usage"))


def first_chunk(token: FirstToken) -> bytes:
    """The SSE chunk vLLM's generate stream writes for ``t1`` (its last one if ``t1`` ends
    the request)."""
    choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": token.finish_reason,
        "stop_reason": token.stop_reason if token.finish_reason else None,
        TOKEN_IDS: [token.token],
        "routed_experts": None,
        "sampling_mask": None,
        "weight_versions": None,
    }
    mode = "tokens"
    if token.text is not None:
        choice["text"], mode = token.text, "text"
    choice["logprobs"] = None
    chunk: dict[str, Any] = {REQUEST_ID: token.request_id, "usage": None, "output_mode": mode}
    chunk["choices"] = [choice]
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def ended_stream(token: FirstToken, include_usage: bool) -> bytes:
    """The whole stream of a request that ``t1`` ended: its chunk, the usage chunk when
    asked (the prefill's usage: the prompt and one token), ``[DONE]``."""
    parts = [first_chunk(token)]
    if include_usage and isinstance(token.usage, dict):
        mode = "tokens" if token.text is None else "text"
        usage: dict[str, Any] = {REQUEST_ID: token.request_id}
        usage.update(usage=_without_nulls(token.usage), output_mode=mode, choices=[])
        parts.append(b"data: " + orjson.dumps(usage) + b"\n\n")
    parts.append(b"data: [DONE]\n\n")
    return b"".join(parts)


def _without_nulls(value: Any) -> Any:
    """pydantic's ``exclude_none`` dump, which the usage chunk has."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    return value


def continued_body(body: Mapping[str, Any], token: int) -> JSONBody:
    """The decode's body: prompt ids + ``[t1]``, ``max_tokens`` and ``min_tokens`` one
    lower (an absent ``max_tokens`` is the room left in the context: one lower by itself)."""
    params = dict(body[SAMPLING_PARAMS])
    for key in (MAX_TOKENS, MIN_TOKENS):
        value = params.get(key)
        if type(value) is int and value > 0:
            params[key] = value - 1
    continued = dict(body)
    continued[TOKEN_IDS] = [*body[TOKEN_IDS], token]
    continued[SAMPLING_PARAMS] = params
    return continued


def fix_usage(chunk: bytes) -> bytes:
    """The decode's chunk with its usage counted as the client's request: the prompt without
    ``t1``, ``t1`` among the completion tokens (the total is the same). Chunks without a
    usage object (every token's) are returned as they are, after one search."""
    if _USAGE_MARK not in chunk:
        return chunk
    return b"\n\n".join(_fixed_event(event) for event in chunk.split(b"\n\n"))


def _fixed_event(event: bytes) -> bytes:
    if _USAGE_MARK not in event or not event.startswith(b"data: {"):
        return event
    try:
        data = orjson.loads(event[6:])
    except orjson.JSONDecodeError:
        return event
    usage = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(usage, dict):
        return event
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if type(prompt) is not int or type(completion) is not int or prompt < 1:
        return event
    usage["prompt_tokens"], usage["completion_tokens"] = prompt - 1, completion + 1
    return b"data: " + orjson.dumps(data)


@dataclass(slots=True)
class _Bounds:
    low: int
    high: int | None  # None: no upper bound seen yet


MAX_BLOCK_SIZE = 2048  # tokens a KV block holds at most in any vLLM configuration


class BlockSizes:
    """Each prefill engine's KV block size, bounded by what its answers show: ``N`` prompt
    tokens held in ``k`` blocks means ``ceil(N / B) == k``. Pure; bounded."""

    def __init__(self) -> None:
        self._bounds: dict[str, _Bounds] = {}

    def observe(self, source: str, tokens: int, blocks: int) -> None:
        if tokens < 1 or blocks < 1:
            return
        low = -(-tokens // blocks)
        high = (tokens - 1) // (blocks - 1) if blocks > 1 else None
        known = self._bounds.get(source)
        if known is not None:
            low = max(low, known.low)
            if known.high is not None:
                high = known.high if high is None else min(high, known.high)
        if high is not None and low > high:  # inconsistent (a restart with another size?)
            low, high = -(-tokens // blocks), (tokens - 1) // (blocks - 1) if blocks > 1 else None
        if known is None and len(self._bounds) >= _MAX_SOURCES:
            self._bounds.clear()
        self._bounds[source] = _Bounds(low, high)

    def too_few(self, source: str, tokens: int, blocks: int) -> bool:
        """The prefill lists fewer blocks than ``tokens`` need at any block size it could
        have (the largest its answers allow, else ``MAX_BLOCK_SIZE``): its answer is not
        to be trusted."""
        if blocks < 1:
            return tokens > 0
        known = self._bounds.get(source)
        largest = known.high if known is not None and known.high is not None else None
        return blocks * (largest or MAX_BLOCK_SIZE) < tokens

    def on_edge(self, source: str, tokens: int, blocks: int) -> bool:
        """Might ``tokens`` + 1 need a block more than the ``blocks`` the prefill lists,
        that is, might the block size be ``tokens / blocks``?"""
        if tokens % blocks:
            return False
        size, known = tokens // blocks, self._bounds.get(source)
        if known is None:
            return True
        return known.low <= size and (known.high is None or size <= known.high)

    def size(self, source: str) -> tuple[int, int | None] | None:
        """The bounds known for ``source``'s block size (low, high), if any."""
        known = self._bounds.get(source)
        return None if known is None else (known.low, known.high)


def held_blocks(answer: Mapping[str, Any]) -> tuple[str, int, int] | None:
    """(engine id, prompt tokens, blocks) of the KV a NIXL prefill holds for its answer, or
    None when its params do not say (or list several KV cache groups)."""
    params = answer.get(KV_TRANSFER_PARAMS)
    if not isinstance(params, dict):
        return None
    engine, tokens = params.get(REMOTE_ENGINE_ID), params.get("remote_num_tokens")
    ids = params.get(REMOTE_BLOCK_IDS)
    if not isinstance(engine, str) or type(tokens) is not int or not isinstance(ids, list):
        return None
    if ids and isinstance(ids[0], list):
        if len(ids) != 1:
            return None
        ids = ids[0]
    return (engine, tokens, len(ids)) if ids else None
