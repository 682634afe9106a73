"""A tiny test driver for sims: requests, SSE collection, and a 1P1D round trip without a proxy."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson

MODEL = "sim-model"
PROMPT = "the quick brown fox jumps over the lazy dog again and again and again"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def body_for(path: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    if path == CHAT:
        messages = [{"role": "user", "content": PROMPT}]
        return {"model": MODEL, "messages": messages, "max_completion_tokens": max_tokens, **extra}
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, **extra}


async def post(
    session: aiohttp.ClientSession, url: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    async with session.post(url, json=body, headers=headers) as resp:
        return resp.status, await resp.read()


def sse_events(raw: bytes) -> list[bytes]:
    return [e[len(b"data: ") :] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]


def text_of(raw: bytes, stream: bool) -> str:
    """The generated text of a completions or chat response, streamed or not."""
    if not stream:
        choice = orjson.loads(raw)["choices"][0]
        return str(choice["text"] if "text" in choice else choice["message"]["content"])
    parts = []
    for event in sse_events(raw):
        if event == b"[DONE]":
            break
        for choice in orjson.loads(event)["choices"]:
            parts.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(parts)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What a PD proxy sends to P (PROTOCOLS.md 0.4)."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "min_tokens")}
    out.update(max_tokens=1, stream=False)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return out


async def prefill(
    session: aiohttp.ClientSession, p_url: str, path: str, body: dict[str, Any]
) -> dict[str, Any] | None:
    status, raw = await post(session, p_url + path, prefill_body(body))
    assert status == 200, raw
    params: dict[str, Any] | None = orjson.loads(raw)["kv_transfer_params"]
    return params


async def decode(
    session: aiohttp.ClientSession,
    d_url: str,
    path: str,
    body: dict[str, Any],
    params: dict[str, Any] | None,
) -> str:
    d_body = dict(body) if params is None else {**body, "kv_transfer_params": params}
    status, raw = await post(session, d_url + path, d_body)
    assert status == 200, raw
    return text_of(raw, bool(body.get("stream")))


async def wait_for(predicate: Callable[[], Any], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not met in time")
