"""vLLM's one-pass endpoints: /tokenize, /detokenize, /v1/embeddings, /pooling, /score and
/rerank (and their aliases), answered with vLLM 0.32's response shapes.

Every answer is a pure function of the request: token ids from the sim's tokenizer
(``model.tokenize``), and an embedding per input from the KV chain of its tokens (a
deterministic unit vector of ``EMBED_DIM`` floats), so two sims give the same bytes for the
same request, except the ids and timestamps vLLM makes fresh for each answer.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import struct
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from engines.sim import model
from engines.sim.config import SimConfig
from engines.sim.errors import ApiError, RequestValidationError

EMBED_DIM = 32  # the sim's "hidden size"; `dimensions` may ask for fewer (Matryoshka)
_BYTE_FORMATS = ("bytes", "bytes_only")
_DTYPES = {"float32": "f", "float16": "e"}


@dataclass(frozen=True)
class Answer:
    """One whole response."""

    body: bytes
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()


def tokenize(body: dict[str, Any], headers: dict[str, str], cfg: SimConfig) -> Answer:
    _check_model(body, cfg)
    if "messages" in body:
        text = _chat_text(body["messages"], body)
    elif isinstance(body.get("prompt"), str):
        text = body["prompt"]
    else:
        raise RequestValidationError("prompt: Field required (a string), or messages")
    words = model.words(text)
    tokens = model.remember(words)
    data = {
        "count": len(tokens),
        "max_model_len": cfg.max_model_len,
        "tokens": tokens,
        "token_strs": words if body.get("return_token_strs") else None,
    }
    return Answer(orjson.dumps(data))


def detokenize(body: dict[str, Any], headers: dict[str, str], cfg: SimConfig) -> Answer:
    _check_model(body, cfg)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        raise RequestValidationError("tokens: a list of non-negative integers is required")
    try:
        text = model.detokenize(tokens)
    except KeyError as exc:
        raise ApiError(400, f"Token id {exc.args[0]} is out of vocabulary") from exc
    return Answer(orjson.dumps({"prompt": text}))


def embeddings(body: dict[str, Any], headers: dict[str, str], cfg: SimConfig) -> Answer:
    _check_model(body, cfg)
    prompts = _inputs(body)
    vectors = [_truncated(_embedding(p), body.get("dimensions")) for p in prompts]
    return _pooled(body, headers, cfg, "embd", "embedding", "embedding", prompts, vectors)


def pooling(body: dict[str, Any], headers: dict[str, str], cfg: SimConfig) -> Answer:
    _check_model(body, cfg)
    prompts = _inputs(body)
    if body.get("task") in ("token_embed", "token_classify"):
        outputs: list[Any] = [[_embedding(p[: i + 1]) for i in range(len(p))] for p in prompts]
    else:
        outputs = [_embedding(p) for p in prompts]
    return _pooled(body, headers, cfg, "pooling", "pooling", "data", prompts, outputs)


def score(body: dict[str, Any], headers: dict[str, str], cfg: SimConfig) -> Answer:
    _check_model(body, cfg)
    first, second = _score_pair_fields(body)
    pairs = _pairs(first, second)
    data = [
        {"index": i, "object": "score", "score": _relevance(q, d)} for i, (q, d) in enumerate(pairs)
    ]
    n = sum(len(model.tokenize(q)) + len(model.tokenize(d)) for q, d in pairs)
    answer = {
        "id": f"score-{_base_id(body, headers)}",
        "object": "list",
        "created": int(time.time()),
        "model": cfg.model,
        "data": data,
        "usage": _usage(n),
    }
    return Answer(orjson.dumps(answer))


def rerank(body: dict[str, Any], headers: dict[str, str], cfg: SimConfig) -> Answer:
    _check_model(body, cfg)
    query, raw = body.get("query"), body.get("documents")
    documents: list[str] = [raw] if isinstance(raw, str) else raw  # type: ignore[assignment]
    if not isinstance(query, str) or not _strings(documents):
        raise RequestValidationError("query (a string) and documents (strings) are required")
    top_n = body.get("top_n") or len(documents)
    scores = [_relevance(query, d) for d in documents]
    order = sorted(range(len(documents)), key=lambda i: scores[i], reverse=True)
    results = [
        {
            "index": i,
            "document": {"text": documents[i], "multi_modal": None},
            "relevance_score": scores[i],
        }
        for i in order
    ]
    n = sum(len(model.tokenize(query)) + len(model.tokenize(d)) for d in documents)
    answer = {
        "id": f"score-{_base_id(body, headers)}",
        "model": cfg.model,
        "usage": {"prompt_tokens": n, "total_tokens": n},
        "results": results[:top_n],
    }
    return Answer(orjson.dumps(answer))


Handler = Callable[[dict[str, Any], dict[str, str], SimConfig], Answer]
HANDLERS: dict[str, Handler] = {
    "/tokenize": tokenize,
    "/detokenize": detokenize,
    "/v1/embeddings": embeddings,
    "/pooling": pooling,
    "/score": score,
    "/v1/score": score,
    "/rerank": rerank,
    "/v1/rerank": rerank,
    "/v2/rerank": rerank,
}


def _check_model(body: dict[str, Any], cfg: SimConfig) -> None:
    name = body.get("model")
    if name is not None and name != cfg.model and name not in cfg.served_models:
        raise ApiError(404, f"The model `{name}` does not exist.", param="model")


def _chat_text(messages: Any, body: dict[str, Any]) -> str:
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RequestValidationError("messages: a list of message objects is required")
    final = bool(body.get("continue_final_message"))
    opener = body.get("add_generation_prompt", True) is not False and not final
    try:
        return model.render_chat(messages, generation_prompt=opener, continue_final=final)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc


def _inputs(body: dict[str, Any]) -> list[list[int]]:
    """Each input's token ids: ``input`` as vLLM reads it, or one chat's ``messages``."""
    if "messages" in body:
        prompts = [model.tokenize(_chat_text(body["messages"], body))]
    else:
        raw = body.get("input")
        if isinstance(raw, str) or (isinstance(raw, list) and raw and type(raw[0]) is int):
            raw = [raw]
        if not isinstance(raw, list) or not raw:
            raise RequestValidationError("input: Field required (a string, strings or token ids)")
        prompts = [_prompt_tokens(p) for p in raw]
    if not all(prompts):
        raise ApiError(400, "The prompt cannot be empty.")
    return prompts


def _prompt_tokens(prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        return model.tokenize(prompt)
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        return list(prompt)
    raise RequestValidationError("input: each item must be a string or a list of token ids")


def _embedding(tokens: Sequence[int]) -> list[float]:
    """A unit vector drawn from the KV chain's last entry: the whole prompt decides it."""
    seed = model.compute_kv(tokens)[-1]
    raw = hashlib.blake2b(seed, digest_size=2 * EMBED_DIM).digest()
    values = [v / 32768 for v in struct.unpack(f">{EMBED_DIM}h", raw)]
    return _normalized(values)


def _truncated(vector: list[float], dimensions: Any) -> list[float]:
    if dimensions is None:
        return vector
    if type(dimensions) is not int or not 1 <= dimensions <= EMBED_DIM:
        raise ApiError(400, f"dimensions must be between 1 and {EMBED_DIM}, got {dimensions!r}")
    return _normalized(vector[:dimensions])


def _normalized(values: list[float]) -> list[float]:
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return [v / norm for v in values]


def _relevance(query: str, document: str) -> float:
    """A cross-encoder-like score in (0, 1): the sigmoid of the embeddings' cosine * 4."""
    q, d = (_embedding(model.tokenize(t) or [0]) for t in (query, document))
    cosine = sum(a * b for a, b in zip(q, d, strict=True))
    return 1 / (1 + math.exp(-4 * cosine))


def _score_pair_fields(body: dict[str, Any]) -> tuple[Any, Any]:
    for first, second in (
        ("queries", "documents"),
        ("queries", "items"),
        ("data_1", "data_2"),
        ("text_1", "text_2"),
    ):
        if first in body and second in body:
            return body[first], body[second]
    raise RequestValidationError("queries and documents (or data_1 and data_2) are required")


def _pairs(first: Any, second: Any) -> list[tuple[str, str]]:
    """vLLM's pairing: one against many, or element-wise for equal-length lists."""
    firsts = [first] if isinstance(first, str) else first
    seconds = [second] if isinstance(second, str) else second
    if not _strings(firsts) or not _strings(seconds):
        raise RequestValidationError("score inputs must be strings or lists of strings")
    if len(firsts) == 1:
        return [(firsts[0], s) for s in seconds]
    if len(firsts) != len(seconds):
        raise ApiError(400, "Input lengths must be either 1:1, 1:N or N:N")
    return list(zip(firsts, seconds, strict=True))


def _strings(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) for v in value)


def _pooled(
    body: dict[str, Any],
    headers: dict[str, str],
    cfg: SimConfig,
    prefix: str,
    obj: str,
    field: str,
    prompts: list[list[int]],
    outputs: list[Any],
) -> Answer:
    """An embeddings or pooling answer in the requested encoding."""
    encoding = body.get("encoding_format", "float")
    dtype = body.get("embed_dtype", "float32")
    endianness = body.get("endianness", "native")
    if dtype not in _DTYPES or endianness not in ("native", "big", "little"):
        raise ApiError(400, f"unsupported embed_dtype {dtype!r} or endianness {endianness!r}")
    response_id = f"{prefix}-{_base_id(body, headers)}"
    usage = _usage(sum(map(len, prompts)))
    if encoding in _BYTE_FORMATS:
        return _bytes_answer(encoding, dtype, endianness, response_id, cfg, outputs, usage)
    if encoding == "base64":
        encoded = [base64.b64encode(_binary(o, dtype, endianness)).decode() for o in outputs]
    elif encoding == "float":
        encoded = outputs
    else:
        raise RequestValidationError(f"encoding_format: unsupported value {encoding!r}")
    data = [{"index": i, "object": obj, field: e} for i, e in enumerate(encoded)]
    answer = {
        "id": response_id,
        "object": "list",
        "created": int(time.time()),
        "model": cfg.model,
        "data": data,
        "usage": usage,
    }
    return Answer(orjson.dumps(answer))


def _bytes_answer(
    encoding: str,
    dtype: str,
    endianness: str,
    response_id: str,
    cfg: SimConfig,
    outputs: list[Any],
    usage: dict[str, Any],
) -> Answer:
    """vLLM's binary encoding: the raw values, and (``bytes``) a ``metadata`` header."""
    chunks = [_binary(o, dtype, endianness) for o in outputs]
    items, offset = [], 0
    for i, (chunk, output) in enumerate(zip(chunks, outputs, strict=True)):
        shape = [len(output), len(output[0])] if isinstance(output[0], list) else [len(output)]
        end = offset + len(chunk)
        items.append(
            {
                "index": i,
                "embed_dtype": dtype,
                "endianness": endianness,
                "start": offset,
                "end": end,
                "shape": shape,
            }
        )
        offset = end
    headers: tuple[tuple[str, str], ...] = ()
    if encoding == "bytes":
        meta = {
            "id": response_id,
            "created": int(time.time()),
            "model": cfg.model,
            "data": items,
            "usage": {
                "prompt_tokens": usage["prompt_tokens"],
                "total_tokens": usage["total_tokens"],
            },
        }
        headers = (("metadata", json.dumps(meta)),)
    return Answer(b"".join(chunks), "application/octet-stream", headers)


def _binary(output: list[Any], dtype: str, endianness: str) -> bytes:
    flat = [v for row in output for v in row] if output and isinstance(output[0], list) else output
    order = {"big": ">", "little": "<"}.get(endianness, "<" if sys.byteorder == "little" else ">")
    return struct.pack(f"{order}{len(flat)}{_DTYPES[dtype]}", *flat)


def _usage(n: int) -> dict[str, Any]:
    return {
        "prompt_tokens": n,
        "total_tokens": n,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def _base_id(body: dict[str, Any], headers: dict[str, str]) -> str:
    """vLLM's base request id: the X-Request-Id header, the body's request_id, or random."""
    return headers.get("x-request-id") or str(body.get("request_id") or uuid.uuid4().hex[:16])
