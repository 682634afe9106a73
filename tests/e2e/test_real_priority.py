"""A request's ``priority`` reaches real vLLM engines through both legs (issue 31, item 5).

A NIXL pair of the tiny model started with vLLM's ``--scheduling-policy priority`` and
``--max-num-seqs 1`` (the session's ``priority_trio``, tests/e2e/conftest.py): the decode
runs one request at a time, so requests that arrive while it is busy wait in its own queue,
which vLLM orders by priority then arrival. Through pdproxy (no admission limit: both
requests reach the engines at once), a request of priority 10 sent before one of priority 0
finishes after it; that order can only come from the decode engine reading each leg's
``priority``. The same holds when the priority is not in the body but is a tenant's default
from ``--tenants``, which pdproxy writes into both legs' bodies. Each answer equals the same
request's without any priority (temperature 0): the order changes, the text does not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import MappingProxyType

import aiohttp
import orjson
import pytest

from engines.vllm.lifecycle import EnginePair
from pdproxy.config.listener import AdmissionConfig
from pdproxy.config.tenants import TenantsConfig, TenantSpec
from tests.e2e.conftest import PriorityTrio
from tests.e2e.test_real_nixl import isolated, proxy_config
from tests.servers import running_proxy

pytestmark = pytest.mark.real_engine


@pytest.fixture
def priority_pair(priority_trio: PriorityTrio) -> EnginePair:
    pair = priority_trio.get()
    priority_trio.meet(pair.prefill)
    return pair


def _body(pair: EnginePair, text: str, max_tokens: int, **extra) -> dict:
    return isolated(
        {
            "model": pair.model,
            "prompt": text,
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            **extra,
        }
    )


async def _complete(
    session: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None
) -> tuple[float, str]:
    async with session.post(url + "/v1/completions", json=body, headers=headers or {}) as r:
        raw = await r.read()
        assert r.status == 200, raw[:300]
        return time.monotonic(), orjson.loads(raw)["choices"][0]["text"]


async def _waiting(session: aiohttp.ClientSession, decode: str) -> float:
    """Requests waiting in the decode engine's own queue (its /metrics)."""
    async with session.get(decode + "/metrics") as r:
        text = await r.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_waiting")
    )


async def _room(session: aiohttp.ClientSession, pair: EnginePair, text: str) -> int:
    """How many tokens the decode can generate after ``text``: its context less the prompt
    (vLLM answers 400 to a ``min_tokens`` above that)."""
    body = {"model": pair.model, "prompt": text}
    async with session.post(pair.decode_url + "/tokenize", json=body) as r:
        assert r.status == 200, await r.text()
        answer = await r.json()
    return int(answer["max_model_len"]) - int(answer["count"])


async def _queued(
    session: aiohttp.ClientSession, decode: str, count: int, blocker: asyncio.Task
) -> bool:
    """Wait until ``count`` requests wait in the decode's queue; False if the blocker ended
    first (the machine was too slow for the two to queue behind it: no order to read)."""
    while not blocker.done():
        if await _waiting(session, decode) >= count:
            return True
        await asyncio.sleep(0.02)
    return False


async def _order(
    session: aiohttp.ClientSession,
    pair: EnginePair,
    url: str,
    low: tuple[dict, dict | None],
    high: tuple[dict, dict | None],
    long_text: str,
) -> tuple[list[str], dict[str, str]]:
    """A long request occupies the decode; then ``low`` (priority 10) and, once it waits in
    the decode's queue, ``high`` (priority 0); returns the order the two finished in and
    their texts. A blocker that ends before both wait is made longer (up to the decode's
    context) and the round re-run (a loaded machine), so the order read is always the
    queue's."""
    room = await _room(session, pair, long_text)
    tokens = min(300, room)
    for _ in range(6):
        blocker = asyncio.create_task(_complete(session, url, _body(pair, long_text, tokens)))
        await asyncio.sleep(0.3)
        first = asyncio.create_task(_complete(session, url, *low))
        if await _queued(session, pair.decode_url, 1, blocker):
            second = asyncio.create_task(_complete(session, url, *high))
            queued = await _queued(session, pair.decode_url, 2, blocker)
        else:
            second, queued = asyncio.create_task(_complete(session, url, *high)), False
        (t_low, text_low), (t_high, text_high), _ = await asyncio.gather(first, second, blocker)
        if queued:
            order = ["high", "low"] if t_high < t_low else ["low", "high"]
            return order, {"low": text_low, "high": text_high}
        tokens = min(tokens * 2, room)
    raise AssertionError("the two requests never waited together behind the blocker")


async def test_priority_orders_the_decode_engines_queue_and_leaves_answers_unchanged(
    priority_pair: EnginePair,
):
    pair = priority_pair
    tenants = TenantsConfig(
        tenants=MappingProxyType({"batch": TenantSpec(priority=10)}),
        header="x-tenant",
    )
    # pdproxy's own leg waits off (capacity 0): the order can only be the engine's
    admission = AdmissionConfig(prefill_capacity=0, decode_capacity=0)
    config = dataclasses.replace(proxy_config(pair), tenants=tenants, admission=admission)
    long_text = "The long one: " + "tick " * 20
    low_text, high_text = "Low priority: " + "tock " * 20, "High priority: " + "tack " * 20
    async with running_proxy(config) as proxy, aiohttp.ClientSession() as session:
        url = proxy.url
        # the reference: each alone, no priority anywhere
        _, alone_low = await _complete(session, url, _body(pair, low_text, 8))
        _, alone_high = await _complete(session, url, _body(pair, high_text, 8))

        # the body's own priority
        order, texts = await _order(
            session,
            pair,
            url,
            (_body(pair, low_text, 8, priority=10), None),
            (_body(pair, high_text, 8, priority=0), None),
            long_text,
        )
        assert order == ["high", "low"], "the decode engine did not order by the body's priority"
        assert texts == {"low": alone_low, "high": alone_high}

        # the tenant's default priority, written into both legs by pdproxy
        order, texts = await _order(
            session,
            pair,
            url,
            (_body(pair, low_text, 8), {"x-tenant": "batch"}),
            (_body(pair, high_text, 8), None),
            long_text,
        )
        assert order == ["high", "low"], "the tenant's priority did not reach the decode engine"
        assert texts == {"low": alone_low, "high": alone_high}
