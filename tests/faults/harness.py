"""The fault matrix's fleet and its invariants.

A 2P2D fleet of simulated engines (NIXL, strict contract) behind a real pdproxy under
uvicorn, all on this event loop, with short timeouts so a fault shows within a second.
Every scenario drives traffic with ``drive`` and ends with ``assert_settled``: every
request ended with a complete answer or a correct OpenAI error, none outlived its bound,
no 200 was empty, and pdproxy's and every engine's in-flight counts are back to 0 with no
upstream connection or task left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson

from engines.sim import SimConfig, model, running_sim
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.resilience import HealthConfig, OutlierConfig, RetryConfig
from pdproxy.config.upstream import Timeouts
from pdproxy.types import EngineAddress
from tests.servers import RunningProxy, running_proxy

MODEL = "sim-model"
PROMPT = "the fault matrix asks every engine to fail in every way it can"

# Short enough that every fault resolves within a second or two, long enough for a loaded
# two-core machine never to trip them on a healthy engine.
HEALTH = HealthConfig(interval=0.25, timeout=1.0, failure_threshold=2, success_threshold=1)
TIMEOUTS = Timeouts(connect=1.0, read=2.0, prefill=1.0, decode_headers=1.0)
OUTLIER = OutlierConfig(base_ejection=1.0, max_ejection=4.0)
RETRY = RetryConfig(initial_backoff=0.02, max_backoff=0.1)
# The cases that show a cut stream's error event: no mid-stream migration (test_migration.py)
NO_MIGRATION = {"retry": dataclasses.replace(RETRY, migration_limit=0)}
REQUEST_BOUND_S = 8.0  # no request may take longer, whatever the fault


@dataclasses.dataclass
class Outcome:
    status: int
    body: bytes
    stream: bool
    seconds: float
    error: str | None = None  # the error type, if the request ended in one

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


@dataclasses.dataclass
class Fleet:
    proxy: RunningProxy
    prefills: list[Any]
    decodes: list[Any]
    tasks_at_start: int = 0  # asyncio tasks once the fleet is up and idle

    @property
    def engines(self) -> list[Any]:
        return self.prefills + self.decodes

    @property
    def state(self):
        return self.proxy.state

    def metric(self, name: str, **labels: str) -> float:
        value = self.state.metrics.registry.get_sample_value(name, labels)
        return value or 0.0

    def instance(self, sim) -> Any:
        return self.state.registry.get(sim.url)

    def breaker(self, sim) -> str:
        return self.state.outliers.state(self.instance(sim)).value


@contextlib.asynccontextmanager
async def fleet(
    *,
    n_prefill: int = 2,
    n_decode: int = 2,
    proxy: dict[str, Any] | None = None,
    prefill_sim: dict[str, Any] | None = None,
    **sim: Any,
) -> AsyncIterator[Fleet]:
    """``sim`` configures every engine, ``prefill_sim`` the prefills alone."""
    connector = sim.pop("connector", "nixl")  # the sim's and pdproxy's alike
    common = dict(connector=connector, model=MODEL, strict=True, **sim)
    prefill = {**common, **(prefill_sim or {})}
    async with contextlib.AsyncExitStack() as stack:
        prefills = [
            await stack.enter_async_context(running_sim(SimConfig(role="prefill", **prefill)))
            for _ in range(n_prefill)
        ]
        decodes = [
            await stack.enter_async_context(running_sim(SimConfig(role="decode", **common)))
            for _ in range(n_decode)
        ]
        settings: dict[str, Any] = dict(
            timeouts=TIMEOUTS, health=HEALTH, outlier=OUTLIER, retry=RETRY
        )
        settings.update(proxy or {})
        config = ProxyConfig(
            prefill=tuple(EngineAddress(url=s.url) for s in prefills),
            decode=tuple(EngineAddress(url=s.url) for s in decodes),
            kv_connector=connector,
            **settings,
        )
        running = await stack.enter_async_context(running_proxy(config))
        yield await idle(Fleet(running, prefills, decodes))


async def idle(f: Fleet) -> Fleet:
    """``f`` with its task count taken once the start-up probes have settled."""
    await f.state.health.settle()
    await asyncio.sleep(0.05)
    f.tasks_at_start = len(asyncio.all_tasks())
    return f


GENERATE = "/inference/v1/generate"


def body(
    i: int, *, stream: bool, chat: bool, max_tokens: int = 6, generate: bool = False
) -> dict[str, Any]:
    if generate:  # the token-in path: vLLM's /inference/v1/generate
        return {
            "model": MODEL,
            "token_ids": model.tokenize(f"{PROMPT} {i}"),
            "sampling_params": {"max_tokens": max_tokens},
            "stream": stream,
        }
    if chat:
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"{PROMPT} {i}"}],
            "max_completion_tokens": max_tokens,
            "stream": stream,
        }
    return {"model": MODEL, "prompt": f"{PROMPT} {i}", "max_tokens": max_tokens, "stream": stream}


async def request(
    session: aiohttp.ClientSession,
    url: str,
    i: int,
    *,
    stream: bool,
    chat: bool = False,
    generate: bool = False,
    **kw: Any,
) -> Outcome:
    path = GENERATE if generate else "/v1/chat/completions" if chat else "/v1/completions"
    started = time.monotonic()
    payload = body(i, stream=stream, chat=chat, generate=generate, **kw)
    async with session.post(url + path, json=payload) as r:
        raw = await r.read()
        status = r.status
    outcome = Outcome(status, raw, stream, time.monotonic() - started)
    outcome.error = _check_answer(outcome)
    return outcome


def _check_answer(outcome: Outcome) -> str | None:
    """The error type the answer carries (None for a complete answer); raises
    AssertionError for an answer that is neither complete nor a correct error."""
    assert outcome.body, f"HTTP {outcome.status} with an empty body"
    if outcome.status != 200:
        error = orjson.loads(outcome.body)["error"]
        assert {"message", "type", "code"} <= set(error), error
        return str(error["type"])
    if not outcome.stream:
        answer = orjson.loads(outcome.body)
        assert answer["choices"], answer
        return None
    events = [e[6:] for e in outcome.body.split(b"\n\n") if e.startswith(b"data: ")]
    assert events and events[-1] == b"[DONE]", outcome.body[-200:]
    payloads = [orjson.loads(e) for e in events[:-1]]
    errors = [p["error"] for p in payloads if "error" in p]
    assert len(errors) <= 1 and (not errors or "error" in payloads[-1]), payloads
    if errors:
        return str(errors[0]["type"])
    assert any(p.get("choices") for p in payloads), payloads
    return None


async def drive(
    f: Fleet, n: int = 16, *, concurrency: int = 4, start: int = 0, **kw: Any
) -> list[Outcome]:
    """``n`` requests, ``concurrency`` at a time, alternating stream/whole and completions/
    chat unless ``stream``/``chat`` are given; each bounded by ``REQUEST_BOUND_S``."""
    gate = asyncio.Semaphore(concurrency)

    async def one(session: aiohttp.ClientSession, i: int) -> Outcome:
        opts = {"stream": i % 2 == 0, "chat": i % 4 >= 2, **kw}
        async with gate:
            return await asyncio.wait_for(request(session, f.proxy.url, i, **opts), REQUEST_BOUND_S)

    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(one(session, start + i) for i in range(n))))


def _flow_settled(flow: dict[str, Any]) -> bool:
    """No leg waits for room, no tenant has a request in flight."""
    return flow["queued"] == 0 and all(t["in_flight"] == 0 for t in flow["tenants"].values())


async def assert_settled(f: Fleet) -> None:
    """Nothing in flight anywhere, and nothing left behind (bounded wait)."""
    state = f.state

    def settled() -> bool:
        engines_idle = all(
            s.gauges().running == 0
            and s.gauges().waiting == 0
            and all(r.outcome != "pending" for r in s.requests)
            for s in f.engines
        )
        admission = state.admission
        return (
            state.in_flight.count == 0
            and (
                admission is None
                or (
                    admission.active == 0
                    and admission.queued == 0
                    and all(t.in_flight == 0 for t in admission.limits._tenants.values())
                    and _flow_settled(admission.book.status())
                )
            )
            and all(
                e.legs.in_flight == 0
                and e.legs.work == 0
                and e.legs.queued_tokens == 0
                and e.legs.reserved == 0
                and not any(e.legs.rank_in_flight)
                for e in state.registry.all()
            )
            and state.client.connections_in_use() == 0
            and engines_idle
        )

    await wait_until(settled, timeout=5, what="in-flight counts back to 0")
    # Out-of-round health probes and KV releases come and go; nothing may stay.
    await wait_until(
        lambda: len(asyncio.all_tasks()) <= f.tasks_at_start,
        timeout=5,
        what=f"no leaked tasks ({len(asyncio.all_tasks())} > {f.tasks_at_start})",
    )


async def wait_until(predicate, *, timeout: float, what: str, interval: float = 0.02) -> float:
    """Seconds until ``predicate()`` held; fails with ``what`` after ``timeout``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        await asyncio.sleep(interval)
    raise AssertionError(f"not within {timeout} s: {what}")


def all_ok(outcomes: list[Outcome]) -> None:
    bad = [(o.status, o.error, o.body[:200]) for o in outcomes if not o.ok]
    assert not bad, bad
