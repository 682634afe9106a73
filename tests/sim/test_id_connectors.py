"""MoRIIO, P2P-NCCL and Mooncake sims, 1P1D without a proxy: KV really crosses a socket."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from engines.sim import SimConfig, SimHandle, running_sim
from engines.sim.connectors import ids
from engines.sim.connectors.mooncake import fetch_query
from engines.sim.model import tokenize
from tests.sim import idpd
from tests.sim.helpers import CHAT, COMPLETIONS, body_for, post, sse_events, text_of, wait_for

BLOCK = 4
FLOWS = {
    "moriio-read": ("moriio", {"transfer_mode": "READ"}),
    "moriio-write": ("moriio", {"transfer_mode": "WRITE"}),
    "p2p-nccl": ("p2p-nccl", {}),
    "mooncake": ("mooncake", {}),
}


@contextlib.asynccontextmanager
async def trio(connector: str, **kw: Any) -> AsyncIterator[tuple[SimHandle, ...]]:
    """A prefill, a decode and a reference single engine."""
    common: dict[str, Any] = dict(connector=connector, block_size=BLOCK, strict=True, **kw)
    async with (
        running_sim(SimConfig(role="prefill", **common)) as p,
        running_sim(SimConfig(role="decode", **common)) as d,
        running_sim(SimConfig(role="both", block_size=BLOCK)) as single,
    ):
        yield p, d, single


async def expected(session: aiohttp.ClientSession, single: SimHandle, path: str, body) -> str:
    _, raw = await post(session, single.url + path, body)
    return text_of(raw, bool(body.get("stream")))


async def run_flow(flow: str, session, p, d, path, body) -> tuple[int, bytes]:
    if flow == "moriio-read":
        _, status, raw = await idpd.moriio_read(session, p, d, path, body)
        return status, raw
    if flow == "moriio-write":
        return await idpd.moriio_write(session, p, d, path, body)
    if flow == "p2p-nccl":
        return await idpd.p2p(session, p, d, path, body)
    return await idpd.mooncake(session, p, d, path, body)


def assert_kv_moved(p: SimHandle, d: SimHandle) -> None:
    assert p.counters.kv_transfers == 1 and d.counters.kv_transfers == 1
    assert p.counters.kv_bytes_sent > 0
    assert d.counters.kv_bytes_received == p.counters.kv_bytes_sent
    assert d.counters.tokens_external_kv_transfer > 0
    assert d.counters.kv_load_failures == 0 and p.counters.contract_violations == 0


@pytest.mark.parametrize("flow", sorted(FLOWS))
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("stream", [False, True])
async def test_1p1d_equals_single_engine(session, flow, path, stream):
    connector, kw = FLOWS[flow]
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    body = body_for(path, 10, **extra)
    async with trio(connector, **kw) as (p, d, single):
        want = await expected(session, single, path, body)
        status, raw = await run_flow(flow, session, p, d, path, body)
        assert status == 200, raw
        assert text_of(raw, stream) == want
        await wait_for(lambda: p.counters.kv_transfers == 1)
        assert_kv_moved(p, d)
        assert p.gauges().kv_usage == 0.0 and d.gauges().kv_usage == 0.0


def test_vllm_regexes_tolerate_internal_ids():
    rid = "___prefill_addr_host:10.0.0.1,handshake:6301,notify:61005___decode_addr_"
    rid += "host:10.0.0.2,handshake:6302,notify:61006_" + "ab" * 16
    for internal in (f"cmpl-{rid}-0-9ee2a877", f"chatcmpl-{rid}-1234abcd"):
        assert ids.moriio_peer(internal, prefill=True) == {
            "host": "10.0.0.1",
            "handshake": "6301",
            "notify": "61005",
        }
        assert ids.moriio_peer(internal, prefill=False) == {
            "host": "10.0.0.2",
            "handshake": "6302",
            "notify": "61006",
        }
    assert ids.moriio_peer("cmpl-plain-0-9ee2a877", prefill=False) is None
    p2p = (
        "cmpl-___prefill_addr_10.0.0.1:21001___decode_addr_10.0.0.2:22001_"
        + "cd" * 16
        + "-0-0a0b0c0d"
    )
    assert ids.p2p_peer(p2p, producer=True) == ("10.0.0.2", 22001)
    assert ids.p2p_peer(p2p, producer=False) == ("10.0.0.1", 21001)
    assert ids.base_request_id(p2p) == p2p[: -len("-0a0b0c0d")]


# MoRIIO READ
async def test_moriio_p_params_follow_vllm(session):
    body = body_for(COMPLETIONS)
    async with trio("moriio", tp_size=2) as (p, d, _single):
        params, status, _ = await idpd.moriio_read(session, p, d, COMPLETIONS, body)
    assert status == 200
    assert set(params) == {
        "do_remote_prefill",
        "do_remote_decode",
        "remote_block_ids",
        "remote_engine_id",
        "remote_host",
        "remote_handshake_port",
        "remote_notify_port",
        "remote_dp_rank",
        "remote_dp_rank_override",
        "remote_dp_size",
        "remote_dp_size_local",
        "tp_size",
        "transfer_id",
        "remote_prefill_cached_tokens",  # added by vLLM's scheduler, for every connector
    }
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == p.engine_id and params["remote_host"] == "127.0.0.1"
    assert params["remote_handshake_port"] == params["remote_notify_port"] == p.kv_port
    assert params["tp_size"] == 2 and params["remote_dp_rank"] == 0
    assert params["transfer_id"].startswith("tx-")
    n = len(tokenize(body["prompt"]))
    assert len(params["remote_block_ids"]) == -(-n // BLOCK)
    assert p.zmq_address == f"host:127.0.0.1,handshake:{p.kv_port},notify:{p.kv_port}"


async def test_moriio_read_wrong_transfer_id_recomputes(session):
    body = body_for(COMPLETIONS, 10)
    async with trio("moriio") as (p, d, single):
        want = await expected(session, single, COMPLETIONS, body)
        _, status, raw = await idpd.moriio_read(
            session, p, d, COMPLETIONS, body, transfer_id="tx-not-the-one"
        )
        assert status == 200 and text_of(raw, False) == want  # recomputed, so still right
        assert d.counters.kv_load_failures == 1 and d.counters.tokens_external_kv_transfer == 0
        assert p.counters.kv_bytes_sent == 0 and p.gauges().kv_usage > 0  # still held


async def test_moriio_read_without_transfer_id_never_matches(session):
    body = body_for(COMPLETIONS, 6)
    async with trio("moriio") as (p, d, single):
        want = await expected(session, single, COMPLETIONS, body)
        rid = idpd.peer_request_id(p, d)
        params = idpd.moriio_d_params("x", p, None)
        del params["transfer_id"]
        status, raw = await post(
            session, d.url + COMPLETIONS, {**body, "kv_transfer_params": params}, idpd.headers(rid)
        )
        assert status == 200 and text_of(raw, False) == want
        assert d.counters.kv_load_failures == 1


async def test_moriio_read_falls_back_to_params_address(session):
    body = body_for(COMPLETIONS, 6)
    async with trio("moriio") as (p, d, single):
        want = await expected(session, single, COMPLETIONS, body)
        rid = idpd.peer_request_id(p, d)
        tx = "tx-fallback"
        _, raw = await post(
            session,
            p.url + COMPLETIONS,
            idpd.p_body(body, idpd.moriio_p_params(tx, d)),
            idpd.headers(rid),
        )
        returned = orjson.loads(raw)["kv_transfer_params"]
        params = {**idpd.moriio_d_params(tx, p, None), **returned, "do_remote_prefill": True}
        # an llm-d-sidecar style id without addresses: D uses remote_host/handshake_port
        status, raw = await post(
            session, d.url + COMPLETIONS, {**body, "kv_transfer_params": params}, {}
        )
        assert status == 200 and text_of(raw, False) == want
        assert d.counters.kv_transfers == 1


@pytest.mark.parametrize(
    ("p_rank", "d_rank", "ok"), [(1, 1, True), (1, None, False), (0, 1, False)]
)
async def test_moriio_read_dp_rank_must_match(session, p_rank, d_rank, ok):
    body = body_for(COMPLETIONS, 8)
    async with trio("moriio", dp_size=2) as (p, d, single):
        want = await expected(session, single, COMPLETIONS, body)
        params, status, raw = await idpd.moriio_read(
            session, p, d, COMPLETIONS, body, p_rank=p_rank, d_rank=d_rank
        )
        assert params["remote_engine_id"] == p.engine_ids[p_rank] != p.engine_ids[1 - p_rank]
        assert params["remote_dp_rank"] == p_rank and params["remote_dp_size"] == 2
        assert status == 200 and text_of(raw, False) == want
        assert d.counters.kv_load_failures == (0 if ok else 1)
        assert d.counters.kv_transfers == (1 if ok else 0)


# MoRIIO WRITE
@pytest.mark.parametrize("d_first_s", [0.2, 0.0])
async def test_moriio_write_either_arrival_order(session, d_first_s):
    body = body_for(CHAT, 8)
    async with trio("moriio", transfer_mode="WRITE") as (p, d, single):
        want = await expected(session, single, CHAT, body)
        status, raw = await idpd.moriio_write(session, p, d, CHAT, body, d_first_s=d_first_s)
        assert status == 200 and text_of(raw, False) == want
        assert_kv_moved(p, d)


async def test_moriio_write_push_before_decode_is_kept(session):
    body = body_for(COMPLETIONS, 8)
    async with trio("moriio", transfer_mode="WRITE") as (p, d, single):
        want = await expected(session, single, COMPLETIONS, body)
        rid, tx = idpd.peer_request_id(p, d), "tx-early"
        await post(
            session,
            p.url + COMPLETIONS,
            idpd.p_body(body, idpd.moriio_p_params(tx, d)),
            idpd.headers(rid),
        )
        await wait_for(lambda: d.gauges().kv_usage > 0)  # parked on D until claimed
        d_body = {**body, "kv_transfer_params": idpd.moriio_d_params(tx, p, None)}
        status, raw = await post(session, d.url + COMPLETIONS, d_body, idpd.headers(rid))
        assert status == 200 and text_of(raw, False) == want
        assert d.gauges().kv_usage == 0.0


@pytest.mark.parametrize("stream", [False, True])
async def test_moriio_write_wrong_dp_rank_times_out(session, stream):
    body = body_for(COMPLETIONS, 8, stream=stream)
    cfg = dict(transfer_mode="WRITE", dp_size=2, kv_wait_timeout_s=0.3)
    async with trio("moriio", **cfg) as (p, d, _single):
        status, raw = await idpd.moriio_write(session, p, d, COMPLETIONS, body, p_rank=1, d_rank=0)
        if stream:
            assert status == 200
            events = sse_events(raw)
            assert orjson.loads(events[0])["error"]["code"] == 500 and events[-1] == b"[DONE]"
        else:
            assert status == 500
            assert orjson.loads(raw)["error"]["type"] == "InternalServerError"
        assert d.counters.kv_load_failures == 1 and d.counters.tokens_external_kv_transfer == 0
        assert d.generation_requests()[-1].outcome == "error"


async def test_moriio_write_decode_notices_disconnect_while_waiting(session):
    body = body_for(COMPLETIONS, 8)
    async with trio("moriio", transfer_mode="WRITE") as (p, d, _single):
        rid = idpd.peer_request_id(p, d)
        d_body = {**body, "kv_transfer_params": idpd.moriio_d_params("tx-never", p, None)}
        task = asyncio.create_task(post(session, d.url + COMPLETIONS, d_body, idpd.headers(rid)))
        await wait_for(d.generation_requests)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await wait_for(lambda: d.generation_requests()[0].outcome == "client_disconnected")
        assert d.counters.client_disconnects == 1 and d.counters.kv_load_failures == 0


# P2P-NCCL
async def test_p2p_decode_without_prefill_times_out(session):
    body = body_for(COMPLETIONS, 8)
    async with trio("p2p-nccl", kv_wait_timeout_s=0.3) as (p, d, _single):
        status, raw = await idpd.p2p(session, p, d, COMPLETIONS, body, run_prefill=False)
        assert status == 500 and b"no KV received" in raw
        assert d.counters.kv_load_failures == 1 and p.counters.kv_bytes_sent == 0


async def test_p2p_decode_always_expects_kv(session):
    async with trio("p2p-nccl", kv_wait_timeout_s=0.3) as (_p, d, _single):
        status, raw = await post(session, d.url + COMPLETIONS, body_for(COMPLETIONS))
        assert status == 500 and b"does not contain hostname and port" in raw


async def test_p2p_zmq_address_and_no_params(session):
    async with trio("p2p-nccl") as (p, d, _single):
        assert p.zmq_address == f"127.0.0.1:{p.kv_port}"
        status, _ = await idpd.p2p(session, p, d, COMPLETIONS, body_for(COMPLETIONS))
        assert status == 200


# Mooncake
async def test_mooncake_query_lists_every_rank(session):
    async with trio("mooncake", dp_size=2) as (p, d, _single):
        assert d.bootstrap_port is None and p.bootstrap_port
        async with session.get(p.bootstrap_url + "/query") as resp:
            assert resp.status == 200
            answer = await resp.json()
        assert await fetch_query(p.bootstrap_url) == answer
    worker = f"127.0.0.1:{p.kv_port}"
    assert answer == {
        str(r): {"engine_id": p.engine_ids[r], "worker_addr": {"0": {"0": worker}}} for r in (0, 1)
    }
    assert p.engine_ids == [f"{p.engine_id}_dp0", f"{p.engine_id}_dp1"]


@pytest.mark.parametrize("rank", [0, 1])
async def test_mooncake_dp_ranks(session, rank):
    body = body_for(COMPLETIONS, 8)
    async with trio("mooncake", dp_size=2) as (p, d, single):
        want = await expected(session, single, COMPLETIONS, body)
        status, raw = await idpd.mooncake(session, p, d, COMPLETIONS, body, rank=rank)
        assert status == 200 and text_of(raw, False) == want
        assert_kv_moved(p, d)


async def test_mooncake_wrong_rank_engine_id_fails_to_load(session):
    body = body_for(COMPLETIONS, 8)
    async with trio("mooncake", dp_size=2) as (p, d, single):
        want = await expected(session, single, COMPLETIONS, body)
        status, raw = await idpd.mooncake(
            session, p, d, COMPLETIONS, body, rank=0, engine_id=p.engine_ids[1]
        )
        assert status == 200 and text_of(raw, False) == want
        assert d.counters.kv_load_failures == 1 and d.counters.tokens_external_kv_transfer == 0
        status, raw = await idpd.mooncake(
            session, p, d, COMPLETIONS, body, engine_id="no-such-engine"
        )
        assert status == 200 and d.counters.kv_load_failures == 2


async def test_mooncake_prefill_without_transfer_id(session, caplog):
    body = body_for(COMPLETIONS, 8)
    async with trio("mooncake", kv_wait_timeout_s=0.3) as (p, d, _single):
        status, _ = await idpd.mooncake(session, p, d, COMPLETIONS, body, p_transfer_id=False)
        assert status == 500  # D waited for KV that P never held
        assert p.counters.contract_violations == 1
        assert d.counters.kv_load_failures == 1
    assert "Missing transfer_id in kv_transfer_params from router!" in caplog.text
