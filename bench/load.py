"""A closed-loop load generator: N workers, each sending one request after another."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
import orjson


@dataclass(frozen=True)
class Result:
    requests: int
    errors: int
    seconds: float
    ttft: list[float]

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    def ttft_ms(self, q: float) -> float:
        ordered = sorted(self.ttft)
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    @property
    def ttft_p50_ms(self) -> float:
        return 1000 * statistics.median(self.ttft)


def merged(results: Sequence[Result]) -> Result:
    """Rounds of the same load as one result: their TTFTs pooled, their times added."""
    return Result(
        sum(r.requests for r in results),
        sum(r.errors for r in results),
        sum(r.seconds for r in results),
        [t for r in results for t in r.ttft],
    )


APIS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
PROMPT = "The quick brown fox jumps over the lazy dog " * 4


def body(max_tokens: int, model: str, tag: str = "", api: str = "completions") -> bytes:
    """A streamed request of ``api`` (a key of ``APIS``): the same text as a prompt, or as
    one user message."""
    text: dict[str, object] = {"prompt": tag + PROMPT}
    if api == "chat":
        text = {"messages": [{"role": "user", "content": tag + PROMPT}]}
    return orjson.dumps({"model": model, **text, "max_tokens": max_tokens, "stream": True})


async def _one(
    session: aiohttp.ClientSession, url: str, payload: bytes, headers: dict[str, str]
) -> float:
    started = time.perf_counter()
    first = 0.0
    async with session.post(url, data=payload, headers=headers) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}")
        async for _ in r.content.iter_any():
            if not first:
                first = time.perf_counter() - started
    return first


async def run(
    base_url: str,
    *,
    concurrency: int,
    total: int,
    max_tokens: int,
    model: str = "sim-model",
    unique_prompts: bool = False,
    api_key: str | None = None,
    on_done: Callable[[], None] | None = None,
    session: aiohttp.ClientSession | None = None,
    api: str = "completions",
    stamps: dict[str, float] | None = None,
) -> Result:
    """``unique_prompts`` gives each request its own prompt, so no engine's prefix cache
    stands in for a prefill or a KV transfer (real engines); ``on_done`` is called after
    each request, answered or failed (the progress bar). With ``session`` (see
    ``clients``), the workers reuse its open connections; else they open their own. ``api``
    is a key of ``APIS``. With ``stamps``, each request carries its own ``X-Request-Id``
    and its TTFT (seconds) is recorded there under that id (``bench.phases`` joins them
    with pdproxy's access lines)."""
    url = base_url + APIS[api]
    payload = body(max_tokens, model, api=api)
    headers = {"Content-Type": "application/json"}
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    ttft: list[float] = []
    errors = 0
    remaining = total

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal remaining, errors
        while remaining > 0:
            remaining -= 1
            data = payload
            if unique_prompts:
                data = body(max_tokens, model, f"[{uuid.uuid4().hex}] ", api)
            sent = headers
            if stamps is not None:
                sent = {**headers, "X-Request-Id": uuid.uuid4().hex}
            try:
                first = await _one(session, url, data, sent)
                ttft.append(first)
                if stamps is not None:
                    stamps[sent["X-Request-Id"]] = first
            except (RuntimeError, aiohttp.ClientError):
                errors += 1
            if on_done is not None:
                on_done()

    async with contextlib.AsyncExitStack() as stack:
        if session is None:
            session = await stack.enter_async_context(client())
        started = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        seconds = time.perf_counter() - started
    return Result(total - errors, errors, seconds, ttft)


def client() -> aiohttp.ClientSession:
    """A client session with no connection limit whose idle connections stay open for a
    minute: measured rounds through it find their connections made (no connect storm of
    N new connections at each round's start)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60), auto_decompress=False
    )
