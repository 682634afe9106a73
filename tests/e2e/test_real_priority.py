"""A request's ``priority`` reaches real vLLM engines through both legs (issue 31, item 5).

A NIXL pair of the tiny model started with vLLM's ``--scheduling-policy priority`` and
``--max-num-seqs 1``: the decode runs one request at a time, so requests that arrive while it
is busy wait in its own queue, which vLLM orders by priority then arrival. Through pdproxy
(no admission limit: both requests reach the engines at once), a request of priority 10 sent
before one of priority 0 finishes after it; that order can only come from the decode engine
reading each leg's ``priority``. The same holds when the priority is not in the body but is a
tenant's default from ``--tenants``, which pdproxy writes into both legs' bodies. Each answer
equals the same request's without any priority (temperature 0): the order changes, the text
does not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterator
from types import MappingProxyType

import aiohttp
import orjson
import pytest

from engines.vllm.lifecycle import EnginePair, vllm_engines
from pdproxy.config.listener import AdmissionConfig
from pdproxy.config.tenants import TenantsConfig, TenantSpec
from tests.e2e.test_real_nixl import isolated, proxy_config
from tests.servers import running_proxy

pytestmark = pytest.mark.real_engine

FLAGS = ("--scheduling-policy", "priority", "--max-num-seqs", "1")


@pytest.fixture(scope="module")
def priority_pair() -> Iterator[EnginePair]:
    with vllm_engines(connector="nixl", extra_args=FLAGS) as pair:
        yield pair


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


async def _order(
    session: aiohttp.ClientSession,
    url: str,
    low: tuple[dict, dict | None],
    high: tuple[dict, dict | None],
    long: dict,
) -> tuple[list[str], dict[str, str]]:
    """A long request occupies the decode; then ``low`` (priority 10), then ``high``
    (priority 0); returns the order the two finished in and their texts."""
    blocker = asyncio.create_task(_complete(session, url, long))
    await asyncio.sleep(0.5)  # its decode runs (~2.5 s): the next two wait in the decode's queue
    first = asyncio.create_task(_complete(session, url, *low))
    await asyncio.sleep(0.3)
    second = asyncio.create_task(_complete(session, url, *high))
    (t_low, text_low), (t_high, text_high), _ = await asyncio.gather(first, second, blocker)
    order = ["high", "low"] if t_high < t_low else ["low", "high"]
    return order, {"low": text_low, "high": text_high}


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
    long = _body(pair, "The long one: " + "tick " * 20, 300)
    low_text, high_text = "Low priority: " + "tock " * 20, "High priority: " + "tack " * 20
    async with running_proxy(config) as proxy, aiohttp.ClientSession() as session:
        url = proxy.url
        # the reference: each alone, no priority anywhere
        _, alone_low = await _complete(session, url, _body(pair, low_text, 8))
        _, alone_high = await _complete(session, url, _body(pair, high_text, 8))

        # the body's own priority
        order, texts = await _order(
            session,
            url,
            (_body(pair, low_text, 8, priority=10), None),
            (_body(pair, high_text, 8, priority=0), None),
            _body(pair, "The long one: " + "tick " * 20, 300),
        )
        assert order == ["high", "low"], "the decode engine did not order by the body's priority"
        assert texts == {"low": alone_low, "high": alone_high}

        # the tenant's default priority, written into both legs by pdproxy
        order, texts = await _order(
            session,
            url,
            (_body(pair, low_text, 8), {"x-tenant": "batch"}),
            (_body(pair, high_text, 8), None),
            long,
        )
        assert order == ["high", "low"], "the tenant's priority did not reach the decode engine"
        assert texts == {"low": alone_low, "high": alone_high}
