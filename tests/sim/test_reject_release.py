"""A decode rejected before admission frees P's KV at once, but only for a warm pair.

vLLM 0.32 (measured): the OpenAI handler's `_with_kv_transfer_rejection_cleanup` makes D
notify P, which frees the held blocks instead of waiting for its lease. The notice goes out
only if D has pulled from that P engine since it started; pydantic rejections never notify.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
import pytest

from engines.sim import SimConfig, SimHandle, running_sim
from engines.sim.connectors import sidechannel
from tests.sim.helpers import CHAT, COMPLETIONS, body_for, decode, post, prefill, wait_for

BEAM_STREAM = {"stream": True, "use_beam_search": True}
BEAM_MESSAGE = b"Streaming is not currently supported with beam search"


@contextlib.asynccontextmanager
async def pair(kv_lease_s: float = 30.0) -> AsyncIterator[tuple[SimHandle, SimHandle]]:
    """A NIXL prefill (long lease by default, so a prompt free cannot be the lease) and a decode."""
    async with (
        running_sim(SimConfig(role="prefill", strict=True, kv_lease_s=kv_lease_s)) as p,
        running_sim(SimConfig(role="decode")) as d,
    ):
        yield p, d


async def warm_up(session, p: SimHandle, d: SimHandle) -> dict[str, Any]:
    """One successful 1P1D round trip: D has now handshaked with P. Returns its params."""
    body = body_for(COMPLETIONS)
    params = await prefill(session, p.url, COMPLETIONS, body)
    assert params is not None
    await decode(session, d.url, COMPLETIONS, body, params)
    assert d.counters.kv_transfers == 1
    return params


async def held_prefill(session, p: SimHandle, path: str = COMPLETIONS) -> dict[str, Any]:
    params = await prefill(session, p.url, path, body_for(path))
    assert params is not None and p.gauges().kv_usage > 0
    return params


async def rejected(
    session, d: SimHandle, params: dict[str, Any], path: str = COMPLETIONS, **change: Any
) -> tuple[int, bytes]:
    return await post(
        session, d.url + path, {**body_for(path), **change, "kv_transfer_params": params}
    )


@pytest.mark.parametrize(
    ("path", "change", "status"),
    [
        (COMPLETIONS, BEAM_STREAM, 400),
        (CHAT, BEAM_STREAM, 400),
        (COMPLETIONS, {"model": "no-such-model"}, 404),
        (COMPLETIONS, {"max_tokens": 100_000}, 400),  # past the context
    ],
)
async def test_warm_pair_rejection_frees_at_once(session, path, change, status):
    async with pair() as (p, d):
        await warm_up(session, p, d)
        params = await held_prefill(session, p, path)
        got, raw = await rejected(session, d, params, path, **change)
        assert got == status, raw
        await wait_for(lambda: p.gauges().kv_usage == 0.0, timeout=1.0)
        assert p.counters.kv_released_on_reject == 1 and p.counters.kv_leases_expired == 0
        assert p.metrics()["sim_kv_released_on_reject_total"] == 1
        assert p.counters.kv_release_unknown == 0
        assert d.generation_requests()[-1].outcome == "error"


async def test_beam_search_stream_is_checked_before_the_model(session):
    async with running_sim() as sim:
        body = {**body_for(COMPLETIONS), "model": "no-such-model", **BEAM_STREAM}
        status, raw = await post(session, sim.url + COMPLETIONS, body)
        assert status == 400 and BEAM_MESSAGE in raw
        assert orjson.loads(raw)["error"]["type"] == "BadRequestError"
        # without streaming, beam search is served as an ordinary request
        status, _ = await post(session, sim.url + COMPLETIONS, {**body, "stream": False})
        assert status == 404
        body = {**body_for(COMPLETIONS), "use_beam_search": True}
        status, _ = await post(session, sim.url + COMPLETIONS, body)
        assert status == 200
        status, _ = await post(session, sim.url + COMPLETIONS, {**body, "use_beam_search": 3})
        assert status == 400


async def test_cold_pair_holds_until_the_lease(session):
    async with pair(kv_lease_s=1.5) as (p, d):
        params = await held_prefill(session, p)
        status, raw = await rejected(session, d, params, **BEAM_STREAM)
        assert status == 400 and BEAM_MESSAGE in raw
        await asyncio.sleep(0.5)
        assert p.gauges().kv_usage > 0 and p.counters.kv_released_on_reject == 0
        await wait_for(lambda: p.gauges().kv_usage == 0.0, timeout=5.0)
        assert p.counters.kv_leases_expired == 1 and p.counters.kv_released_on_reject == 0


# bodies vLLM's pydantic schema refuses before the handler runs (FastAPI's 400)
SCHEMA_BREAKERS: dict[str, Callable[[dict[str, Any]], bytes]] = {
    "max_tokens-not-int": lambda body: orjson.dumps({**body, "max_tokens": "abc"}),
    "stream-not-bool": lambda body: orjson.dumps({**body, "stream": "maybe"}),  # "yes" is true
    "not-an-object": lambda body: orjson.dumps([body]),
    "not-json": lambda body: orjson.dumps(body)[:-1],
}


@pytest.mark.parametrize("breaker", SCHEMA_BREAKERS.values(), ids=SCHEMA_BREAKERS.keys())
async def test_schema_rejection_does_not_notify(session, breaker):
    async with pair() as (p, d):
        await warm_up(session, p, d)
        params = await held_prefill(session, p)
        data = breaker({**body_for(COMPLETIONS), "kv_transfer_params": params})
        headers = {"content-type": "application/json"}
        async with session.post(d.url + COMPLETIONS, data=data, headers=headers) as resp:
            assert resp.status == 400
        await asyncio.sleep(0.3)
        assert p.gauges().kv_usage > 0 and p.counters.kv_released_on_reject == 0


async def test_second_release_is_unrecognized(session, caplog):
    async with pair() as (p, d):
        await warm_up(session, p, d)
        params = await held_prefill(session, p)
        status, _ = await rejected(session, d, params, **BEAM_STREAM)
        assert status == 400
        await wait_for(lambda: p.counters.kv_released_on_reject == 1, timeout=1.0)
        status, _ = await rejected(session, d, params, **BEAM_STREAM)  # the same id again
        assert status == 400
        await wait_for(lambda: p.counters.kv_release_unknown == 1, timeout=1.0)
        assert p.counters.kv_released_on_reject == 1
        assert p.metrics()["sim_kv_release_unknown_total"] == 1
    rid = params["remote_request_id"]
    assert f"Potentially invalid KV blocks for unrecognized request {rid}" in caplog.text


async def test_release_of_pulled_blocks_is_unrecognized(session):
    async with pair() as (p, d):
        pulled = await warm_up(session, p, d)
        status, _ = await rejected(session, d, pulled, model="no-such-model")
        assert status == 404
        await wait_for(lambda: p.counters.kv_release_unknown == 1, timeout=1.0)
        assert p.counters.kv_released_on_reject == 0 and p.counters.kv_transfers == 1


async def test_restarted_decode_is_cold_again(session):
    async with pair() as (p, d):
        await warm_up(session, p, d)
        await d.restart()
        params = await held_prefill(session, p)
        status, _ = await rejected(session, d, params, **BEAM_STREAM)
        assert status == 400
        await asyncio.sleep(0.5)
        assert p.gauges().kv_usage > 0 and p.counters.kv_released_on_reject == 0
        # one pull warms the new D again; the held request is then released on rejection
        await decode(
            session, d.url, COMPLETIONS, body_for(COMPLETIONS), await held_prefill(session, p)
        )
        status, _ = await rejected(session, d, params, **BEAM_STREAM)
        assert status == 400
        await wait_for(lambda: p.gauges().kv_usage == 0.0, timeout=1.0)
        assert p.counters.kv_released_on_reject == 1


async def test_answer_does_not_wait_and_stop_cancels_the_notice(session):
    """A P side channel that never answers a notice: D answers 400 anyway, and kill ends it."""
    noticed, hung_up = asyncio.Event(), asyncio.Event()
    async with pair() as (p, d):

        async def slow_p(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            msg = await sidechannel.read_frame(reader)
            if msg.get("op") == "release":  # sit on it until D hangs up
                noticed.set()
                await reader.read()
                hung_up.set()
            else:  # a pull: relay it to the real P
                reply = await sidechannel.request("127.0.0.1", p.kv_port, msg, 5.0)
                writer.write(sidechannel.encode_frame(reply))
                await writer.drain()
            writer.close()

        relay = await asyncio.start_server(slow_p, "127.0.0.1", 0)
        port = relay.sockets[0].getsockname()[1]
        try:
            body = body_for(COMPLETIONS)
            warm = {**await held_prefill(session, p), "remote_port": port}
            await decode(session, d.url, COMPLETIONS, body, warm)
            params = {**await held_prefill(session, p), "remote_port": port}
            status, _ = await rejected(session, d, params, **BEAM_STREAM)
            assert status == 400
            await asyncio.wait_for(noticed.wait(), 2.0)
            await asyncio.wait_for(d.kill(), 2.0)
            await asyncio.wait_for(hung_up.wait(), 2.0)
            assert not [t for t in asyncio.all_tasks() if "_notify" in repr(t.get_coro())]
        finally:
            relay.close()
            await relay.wait_closed()
