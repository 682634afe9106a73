"""The sim's push connector enforces vLLM 0.32's NixlPushConnector contract, driven by hand
(no proxy): both legs with one X-Request-Id on one endpoint family, the decode's required
keys, the registration matched by id on the prefill, the decode that waits for ever and the
one that leaks when aborted while it waits."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from engines.sim import SimConfig, SimHandle, running_sim
from tests.sim.helpers import CHAT, COMPLETIONS, body_for, post, prefill_body, text_of, wait_for

BLOCK = 4


@contextlib.asynccontextmanager
async def trio(**kw: Any) -> AsyncIterator[tuple[SimHandle, SimHandle, SimHandle]]:
    common = dict(connector="nixl-push", block_size=BLOCK, strict=True, **kw)
    async with (
        running_sim(SimConfig(role="prefill", **common)) as p,
        running_sim(SimConfig(role="decode", **common)) as d,
        running_sim(SimConfig(role="both", block_size=BLOCK)) as single,
    ):
        yield p, d, single


def decode_params(answer: dict[str, Any]) -> dict[str, Any]:
    """A concurrent decode leg's params, from what the prefill's answer said (pdproxy learns
    them so)."""
    keys = ("remote_engine_id", "remote_host", "remote_port", "tp_size", "pp_size")
    params = {k: answer[k] for k in keys}
    return {
        **params,
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_request_id": "x",
    }


async def coordinates(session: aiohttp.ClientSession, p: SimHandle) -> dict[str, Any]:
    """One serial push teaches them (and shows P's answer is push's)."""
    status, raw = await post(session, p.url + COMPLETIONS, prefill_body(body_for(COMPLETIONS)))
    assert status == 200, raw
    answer: dict[str, Any] = orjson.loads(raw)["kv_transfer_params"]
    assert answer["transfer_mode"] == "push" and answer["do_remote_prefill"] is True
    return answer


def leg(body: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    return {**body, "kv_transfer_params": params}


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_concurrent_legs_equal_a_single_engine_and_the_kv_is_written(session, path):
    async with trio() as (p, d, single):
        params = decode_params(await coordinates(session, p))
        body = body_for(path, 6, stream=True)
        _, raw = await post(session, single.url + path, body)
        headers = {"X-Request-Id": "both-legs"}
        decode = asyncio.create_task(post(session, d.url + path, leg(body, params), headers))
        await asyncio.sleep(0.05)  # the decode registers first: it waits for the write
        status, _ = await post(session, p.url + path, prefill_body(body), headers)
        assert status == 200
        status, got = await decode
        assert status == 200 and text_of(got, True) == text_of(raw, True)
        assert d.counters.kv_transfers == 1
        await wait_for(lambda: d.gauges().kv_usage == 0)


async def test_a_missing_required_key_kills_the_decode_engine(session):
    async with trio() as (p, d, _):
        params = decode_params(await coordinates(session, p))
        del params["remote_request_id"]
        status, raw = await post(session, d.url + COMPLETIONS, leg(body_for(COMPLETIONS), params))
        assert status == 500 and b"EngineCore encountered an issue" in raw
        status, _ = await post(session, d.url + COMPLETIONS, body_for(COMPLETIONS))
        assert status == 500  # dead: every later request too


async def test_another_engine_id_fails_at_once(session):
    async with trio() as (p, d, _):
        params = {**decode_params(await coordinates(session, p)), "remote_engine_id": "other"}
        status, raw = await post(session, d.url + COMPLETIONS, leg(body_for(COMPLETIONS), params))
        assert status == 500 and b"handshake" in raw


async def test_another_family_never_matches_and_an_aborted_wait_leaks_until_the_write(session):
    """A chat prefill leg never answers a completions registration (the ids' prefixes
    differ); the decode request, aborted while it waits, keeps its blocks until a prefill
    leg with its id and family finishes on that prefill."""
    async with trio() as (p, d, _):
        params = decode_params(await coordinates(session, p))
        headers = {"X-Request-Id": "family"}
        waiting = asyncio.create_task(
            post(session, d.url + COMPLETIONS, leg(body_for(COMPLETIONS), params), headers)
        )
        await wait_for(lambda: d.gauges().kv_usage > 0)
        status, _ = await post(session, p.url + CHAT, prefill_body(body_for(CHAT)), headers)
        assert status == 200
        await asyncio.sleep(0.2)
        assert not waiting.done()  # no match: still waiting
        waiting.cancel()  # the client leaves: vLLM's abort while it waits
        await asyncio.gather(waiting, return_exceptions=True)
        await asyncio.sleep(0.2)
        assert d.gauges().kv_usage > 0 and d.gauges().running == 0  # leaked
        body = prefill_body(body_for(COMPLETIONS))
        status, _ = await post(session, p.url + COMPLETIONS, body, headers)
        assert status == 200
        await wait_for(lambda: d.gauges().kv_usage == 0)  # the write freed them


async def test_a_decode_needing_more_blocks_than_the_prefill_finished_waits_for_ever(session):
    async with trio() as (p, d, _):
        params = decode_params(await coordinates(session, p))
        headers = {"X-Request-Id": "boundary"}
        short = body_for(COMPLETIONS)
        longer = {**short, "prompt": short["prompt"] + " and a few more words past a block"}
        waiting = asyncio.create_task(
            post(session, d.url + COMPLETIONS, leg(longer, params), headers)
        )
        await asyncio.sleep(0.05)
        await post(session, p.url + COMPLETIONS, prefill_body(short), headers)
        await asyncio.sleep(0.3)
        assert not waiting.done()
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)


async def test_a_prefill_restarted_under_the_same_engine_id_is_never_heard_again(session):
    async with trio(engine_id="fixed-prefill") as (p, d, _):
        params = decode_params(await coordinates(session, p))
        first = body_for(COMPLETIONS)
        headers = {"X-Request-Id": "before"}
        decode = asyncio.create_task(
            post(session, d.url + COMPLETIONS, leg(first, params), headers)
        )
        await asyncio.sleep(0.05)
        await post(session, p.url + COMPLETIONS, prefill_body(first), headers)
        assert (await decode)[0] == 200  # the decode met this agent
        await p.restart()
        params = decode_params(await coordinates(session, p))
        headers = {"X-Request-Id": "after"}
        waiting = asyncio.create_task(
            post(session, d.url + COMPLETIONS, leg(first, params), headers)
        )
        await asyncio.sleep(0.05)
        await post(session, p.url + COMPLETIONS, prefill_body(first), headers)
        await asyncio.sleep(0.3)
        assert not waiting.done()  # its registration went to the dead agent
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
