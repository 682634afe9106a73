"""Driving the scheduling benchmark's load: open-loop arrivals, chat sessions, engine probes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

import aiohttp
import orjson

from bench.fleet import in_background
from bench.sched_stats import Answer, inflight
from bench.sched_workloads import ChatSession, Timed, chat_turn, first_messages, next_messages

_TIMEOUT = aiohttp.ClientTimeout(total=120)


def parse_stream(raw: bytes) -> tuple[str, int]:
    """(generated text, completion tokens) of an OpenAI SSE stream, completions or chat."""
    parts: list[str] = []
    usage_tokens: int | None = None
    for line in raw.split(b"\n"):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        try:
            chunk = orjson.loads(line[6:])
        except orjson.JSONDecodeError:
            continue
        if not isinstance(chunk, dict):
            continue
        usage = chunk.get("usage")
        if isinstance(usage, dict) and "completion_tokens" in usage:
            usage_tokens = int(usage["completion_tokens"])
        for choice in chunk.get("choices") or ():
            piece = choice.get("text") or (choice.get("delta") or {}).get("content")
            if piece:
                parts.append(piece)
    return "".join(parts), usage_tokens if usage_tokens is not None else len(parts)


def usage_of(raw: bytes) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of a stream's usage chunk; (0, 0) without one."""
    for line in raw.split(b"\n"):
        if not line.startswith(b"data: {") or b'"usage"' not in line:
            continue
        try:
            usage = orjson.loads(line[6:]).get("usage")
        except orjson.JSONDecodeError:
            continue
        if isinstance(usage, dict) and "prompt_tokens" in usage:
            details = usage.get("prompt_tokens_details") or {}
            return int(usage["prompt_tokens"]), int(details.get("cached_tokens") or 0)
    return 0, 0


async def send(session: aiohttp.ClientSession, base_url: str, req: Timed) -> Answer:
    """One streamed request; never raises for HTTP or network trouble."""
    started = time.perf_counter()
    first = 0.0
    body = bytearray()
    try:
        async with session.post(base_url + req.path, json=req.body, headers=req.headers) as r:
            async for chunk in r.content.iter_any():
                if not first:
                    first = time.perf_counter() - started
                body += chunk
            status = r.status
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return Answer(req.kind, False, 0.0, 0)
    if status != 200 or b"data: [DONE]" not in body:
        return Answer(req.kind, False, first, 0)
    text, tokens = parse_stream(bytes(body))
    return Answer(req.kind, True, first, tokens, text, *usage_of(bytes(body)))


async def open_loop(
    session: aiohttp.ClientSession,
    base_url: str,
    plan: Sequence[Timed],
    direct: Sequence[str] = (),
) -> list[Answer]:
    """Send each request at its time, whatever the answers do meanwhile; one with a
    ``target`` goes straight to ``direct[target]`` (another client of the engines)."""
    start = time.monotonic()
    tasks = []
    for req in plan:
        delay = start + req.at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        url = base_url if req.target is None else direct[req.target]
        tasks.append(asyncio.create_task(send(session, url, req)))
    return list(await asyncio.gather(*tasks))


async def serial(
    session: aiohttp.ClientSession,
    base_url: str,
    plan: Sequence[Timed],
    direct: Sequence[str] = (),
) -> list[Answer]:
    """Each request of ``plan`` in its order, the next once the last answered: a quiet
    fleet, where nothing queues and only the policy decides where a prompt goes."""
    answers = []
    for req in plan:
        url = base_url if req.target is None else direct[req.target]
        answers.append(await send(session, url, req))
    return answers


async def converse(
    session: aiohttp.ClientSession, base_url: str, chat: ChatSession, max_tokens: int
) -> list[Answer]:
    """One session's turns in order; each turn carries the history so far."""
    await asyncio.sleep(chat.start_at)
    answers: list[Answer] = []
    messages = first_messages(chat)
    for turn in range(len(chat.user_turns)):
        answer = await send(session, base_url, chat_turn(chat, messages, max_tokens))
        answers.append(answer)
        if not answer.ok or turn + 1 == len(chat.user_turns):
            break
        await asyncio.sleep(chat.think_s[turn])
        messages = next_messages(messages, answer.text, chat.user_turns[turn + 1])
    return answers


async def conversations(
    session: aiohttp.ClientSession,
    base_url: str,
    chats: Sequence[ChatSession],
    max_tokens: int,
) -> list[Answer]:
    runs = await asyncio.gather(*(converse(session, base_url, c, max_tokens) for c in chats))
    return [a for run in runs for a in run]


async def metrics_pages(session: aiohttp.ClientSession, urls: Sequence[str]) -> list[str]:
    """Every engine's /metrics text ("" for one that does not answer)."""

    async def page(url: str) -> str:
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with session.get(url + "/metrics") as r:
                return await r.text()
        return ""

    return list(await asyncio.gather(*(page(u) for u in urls)))


class InflightSampler:
    """Every `interval` s, every engine's running + waiting requests (one list per sample)."""

    def __init__(self, session: aiohttp.ClientSession, urls: Sequence[str], interval: float):
        self.session = session
        self.urls = list(urls)
        self.interval = interval
        self.samples: list[list[float]] = []

    def running(self) -> contextlib.AbstractAsyncContextManager[InflightSampler]:
        return in_background(self, self._loop())

    async def _loop(self) -> None:
        while True:
            pages = await metrics_pages(self.session, self.urls)
            if all(pages):
                self.samples.append([inflight(p) for p in pages])
            await asyncio.sleep(self.interval)


def client_session() -> aiohttp.ClientSession:
    """The load's session: no connection cap (aiohttp's default is 100), long timeout."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=_TIMEOUT)
