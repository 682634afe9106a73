"""vLLM's Responses API, ``POST /v1/responses``: generation from ``instructions`` and
``input`` (the chat template over them), answered whole or as vLLM's SSE events.

Stateful as vLLM is: with ``responses_store`` (vLLM's ``VLLM_ENABLE_RESPONSES_API_STORE=1``)
and ``store`` (default true) in the request, the sim keeps the response and its
conversation, and a later request naming it in ``previous_response_id`` continues it; a
``previous_response_id`` this sim does not hold is answered 404, as vLLM answers. The
response id is the body's ``request_id`` when given (vLLM's extra parameter), else
``resp_`` + 16 random hex.

Streamed: ``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, one ``response.output_text.delta`` per token,
``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done``, ``response.completed``; each ``event: <type>`` +
``data: <json>``, numbered by ``sequence_number``, with no ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import orjson

from engines.sim import model
from engines.sim.config import SimConfig
from engines.sim.engine import Prefill
from engines.sim.errors import ApiError, RequestValidationError
from engines.sim.generate import SSE, Job, _hang_after, _on_cancel, _Pacer, _timed_pieces
from engines.sim.openai_api import GenRequest, _dp_rank, _stop

_STORE_LIMIT = 10000  # stored responses kept (vLLM never evicts; the sim must stay bounded)


@dataclass
class Stored:
    messages: list[dict[str, Any]]  # the conversation so far, the answer included
    response: dict[str, Any]


class ResponseStore:
    """What ``store: true`` keeps: the newest responses by id."""

    def __init__(self, enabled: bool, limit: int = _STORE_LIMIT) -> None:
        self.enabled = enabled
        self._limit = limit
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def get(self, response_id: str) -> Stored | None:
        return self._items.get(response_id)

    def put(self, response_id: str, stored: Stored) -> None:
        self._items[response_id] = stored
        while len(self._items) > self._limit:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class Call:
    """One parsed /v1/responses request."""

    req: GenRequest
    messages: list[dict[str, Any]]
    store: bool
    created: int = field(default_factory=lambda: int(time.time()))
    item_id: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex[:16]}")
    sequence: int = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        """One SSE event; ``sequence_number`` and ``type`` close its JSON, as vLLM's."""
        data = {**fields, "sequence_number": self.sequence, "type": kind}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def parse(
    body: dict[str, Any], headers: dict[str, str], cfg: SimConfig, store: ResponseStore
) -> Call:
    """Validate like vLLM; raises ApiError (404 for an unknown previous response)."""
    name = body.get("model")
    if name is not None and name != cfg.model and name not in cfg.served_models:
        raise ApiError(404, f"The model `{name}` does not exist.", param="model")
    messages = _conversation(body, store)
    tokens = model.tokenize(model.render_chat(messages))
    response_id = body.get("request_id") or f"resp_{uuid.uuid4().hex[:16]}"
    if not isinstance(response_id, str):
        raise RequestValidationError("request_id: Input should be a valid string")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise RequestValidationError("stream: Input should be a valid boolean")
    req = GenRequest(
        kind="chat",
        body=body,
        model=cfg.model,
        prompt_tokens=tokens,
        max_tokens=_max_tokens(body, len(tokens), cfg.max_model_len),
        stream=stream,
        include_usage=False,
        stop=_stop(body),
        response_id=response_id,
        internal_id=f"{response_id}-{uuid.uuid4().hex[:8]}",
        kv_transfer_params=None,
        dp_rank=_dp_rank(headers, cfg.dp_size),
    )
    return Call(req, messages, body.get("store", True) is not False and store.enabled)


def not_found(response_id: str) -> bytes:
    """vLLM's 404 for an unknown ``previous_response_id``."""
    error = {
        "message": f"Response with id '{response_id}' not found.",
        "type": "invalid_request_error",
        "param": "response_id",
        "code": 404,
    }
    return orjson.dumps({"error": error})


class PreviousNotFound(ApiError):
    def __init__(self, response_id: str) -> None:
        super().__init__(404, f"Response with id '{response_id}' not found.")
        self.response_id = response_id

    def body(self) -> bytes:
        return not_found(self.response_id)


def _conversation(body: dict[str, Any], store: ResponseStore) -> list[dict[str, Any]]:
    """The messages the model sees: instructions, the previous conversation, the input."""
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    previous = body.get("previous_response_id")
    if previous is not None:
        stored = store.get(previous) if isinstance(previous, str) else None
        if stored is None:
            raise PreviousNotFound(str(previous))
        messages.extend(m for m in stored.messages if m.get("role") != "system")
    raw = body.get("input")
    if isinstance(raw, str):
        messages.append({"role": "user", "content": raw})
    elif isinstance(raw, list) and raw and all(isinstance(m, dict) for m in raw):
        messages.extend({"role": m.get("role", "user"), "content": m.get("content")} for m in raw)
    else:
        raise RequestValidationError("input: Field required (a string or a list of items)")
    return messages


def _max_tokens(body: dict[str, Any], n_prompt: int, max_model_len: int) -> int:
    value = body.get("max_output_tokens")
    room = max_model_len - n_prompt
    if room <= 0 or (type(value) is int and value > room):
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {n_prompt + (value or 0)} tokens. Please reduce the length of the input.",
        )
    if value is None:
        return room
    if type(value) is not int or value < 1:
        raise RequestValidationError(f"max_output_tokens must be at least 1, got {value!r}.")
    return value


async def serve(job: Job, call: Call, store: ResponseStore) -> None:
    """Wait for a slot, prefill, generate; then answer whole or as events."""
    rank = job.engine.rank_of(job.req)
    try:
        await rank.scheduler.acquire(job.req.priority)
    except asyncio.CancelledError:
        _on_cancel(job)
        return
    blocks = job.engine.blocks_for(job.req)
    rank.running_blocks += blocks
    try:
        pre = job.engine.prefill(job.req, None)
        await asyncio.sleep(pre.overhead_s(job.engine.config))
        await rank.compute(pre.compute_s(job.engine.config))
        if job.req.stream:
            await _stream(job, call, pre, store)
        else:
            await _whole(job, call, pre, store)
    except asyncio.CancelledError:
        _on_cancel(job)
    finally:
        rank.running_blocks -= blocks
        rank.scheduler.release()


async def _whole(job: Job, call: Call, pre: Prefill, store: ResponseStore) -> None:
    pieces, out = await _timed_pieces(job, pre)
    limit = job.faults.close_after_tokens
    if limit is not None and limit < len(pieces):
        job.rec.fail(None, f"fault: closed after {limit} tokens")
        job.conn.abort()
        return
    text = "".join(pieces)
    response = _response(call, "completed", [_message(call, text)], out, pre)
    _keep(store, call, text, response)
    job.conn.send(200, orjson.dumps(response))
    job.rec.complete()


async def _stream(job: Job, call: Call, pre: Prefill, store: ResponseStore) -> None:
    conn, eng, req = job.conn, job.engine, job.req
    conn.start_stream(200, SSE)
    opening = _response(call, "in_progress", [], None, pre)
    conn.write_chunk(
        call.event("response.created", response=opening)
        + call.event("response.in_progress", response=opening)
        + call.event(
            "response.output_item.added", item=_item(call, [], "in_progress"), output_index=0
        )
        + call.event("response.content_part.added", **_part_fields(call, _part("", [])))
    )
    pacer = _Pacer(eng.config.decode_tps)
    pieces: list[str] = []
    limit = job.faults.close_after_tokens
    reason, stop = "length", None
    for piece, finish, stop_reason in eng.steps(req, pre):
        await pacer.wait(len(pieces))
        if limit is not None and len(pieces) >= limit:
            job.rec.fail(200, f"fault: closed after {limit} tokens")
            conn.abort()
            return
        await _hang_after(job, len(pieces))
        pieces.append(piece)
        if finish is not None:
            reason, stop = finish, stop_reason
        conn.write_chunk(call.event("response.output_text.delta", **_delta_fields(call, piece)))
        await conn.drain()
        if conn.closed:
            raise asyncio.CancelledError
    text = "".join(pieces)
    out = eng.finish(req, pre, text, len(pieces), reason, stop)
    response = _response(call, "completed", [_message(call, text)], out, pre)
    _keep(store, call, text, response)
    conn.write_chunk(
        _closing_events(call, text) + call.event("response.completed", response=response)
    )
    conn.end_stream()
    job.rec.complete()


def _closing_events(call: Call, text: str) -> bytes:
    done_part = _part(text, None)
    return (
        call.event(
            "response.output_text.done",
            content_index=0,
            item_id=call.item_id,
            logprobs=[],
            output_index=0,
            text=text,
        )
        + call.event("response.content_part.done", **_part_fields(call, done_part))
        + call.event(
            "response.output_item.done",
            item=_item(call, [done_part] if text else [], "completed"),
            output_index=0,
        )
    )


def _keep(store: ResponseStore, call: Call, text: str, response: dict[str, Any]) -> None:
    if call.store:
        answer = {"role": "assistant", "content": text}
        store.put(call.req.response_id, Stored([*call.messages, answer], response))


def _part(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def _part_fields(call: Call, part: dict[str, Any]) -> dict[str, Any]:
    return {"content_index": 0, "item_id": call.item_id, "output_index": 0, "part": part}


def _delta_fields(call: Call, delta: str) -> dict[str, Any]:
    return {
        "content_index": 0,
        "delta": delta,
        "item_id": call.item_id,
        "logprobs": [],
        "output_index": 0,
    }


def _item(call: Call, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {
        "id": call.item_id,
        "content": content,
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def _message(call: Call, text: str) -> dict[str, Any]:
    return _item(call, [_part(text, None)], "completed")


def _response(
    call: Call, status: str, output: list[dict[str, Any]], out: Any, pre: Prefill
) -> dict[str, Any]:
    """vLLM's ``ResponsesResponse.model_dump()``, its fields in its order."""
    body, req = call.req.body, call.req
    incomplete = out is not None and out.finish_reason == "length"
    tools = body.get("tools") or []
    return {
        "id": req.response_id,
        "created_at": call.created,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.get("instructions"),
        "metadata": body.get("metadata"),
        "model": req.model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "temperature": body.get("temperature", 1.0),
        "tool_choice": body.get("tool_choice", "auto") if tools else "none",
        "tools": tools,
        "top_p": body.get("top_p", 1.0),
        "background": body.get("background", False),
        "max_output_tokens": req.max_tokens,
        "max_tool_calls": body.get("max_tool_calls"),
        "previous_response_id": body.get("previous_response_id"),
        "prompt": None,
        "reasoning": None,
        "service_tier": body.get("service_tier", "auto"),
        "status": "incomplete" if incomplete and status == "completed" else status,
        "text": body.get("text"),
        "top_logprobs": None,
        "truncation": body.get("truncation", "disabled"),
        "usage": None
        if out is None
        else _usage(len(req.prompt_tokens), out.completion_tokens, pre),
        "user": body.get("user"),
        "presence_penalty": body.get("presence_penalty") or 0.0,
        "frequency_penalty": body.get("frequency_penalty") or 0.0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


def _usage(n_prompt: int, n_output: int, pre: Prefill) -> dict[str, Any]:
    return {
        "input_tokens": n_prompt,
        "input_tokens_details": {
            "cached_tokens": pre.cached,
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": n_output,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": n_prompt + n_output,
    }
