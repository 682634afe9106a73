"""A 1P1D driver for the id-embedding connectors, legs built as PROTOCOLS.md describes."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aiohttp
import orjson

from engines.sim import SimHandle
from tests.sim.helpers import post, prefill_body


def peer_request_id(p: SimHandle, d: SimHandle) -> str:
    return f"___prefill_addr_{p.zmq_address}___decode_addr_{d.zmq_address}_{uuid.uuid4().hex}"


def headers(rid: str, rank: int | None = None) -> dict[str, str]:
    out = {"X-Request-Id": rid}
    if rank is not None:
        out["X-data-parallel-rank"] = str(rank)
    return out


def p_body(body: dict[str, Any], params: dict[str, Any] | None) -> dict[str, Any]:
    out = prefill_body(body)
    if params is None:
        del out["kv_transfer_params"]
    else:
        out["kv_transfer_params"] = params
    return out


def moriio_p_params(transfer_id: str, d: SimHandle) -> dict[str, Any]:
    return {
        "remote_dp_size": d.config.dp_size,
        "remote_tp_size": d.config.tp_size,
        "transfer_id": transfer_id,
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
    }


def moriio_d_params(transfer_id: str, p: SimHandle, rank: int | None) -> dict[str, Any]:
    params: dict[str, Any] = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "transfer_id": transfer_id,
        "remote_dp_size": p.config.dp_size,
        "remote_tp_size": p.config.tp_size,
    }
    if rank is not None:
        params["remote_dp_rank"] = rank
    return params


async def moriio_read(
    session: aiohttp.ClientSession,
    p: SimHandle,
    d: SimHandle,
    path: str,
    body: dict[str, Any],
    *,
    p_rank: int | None = None,
    d_rank: int | None = None,
    transfer_id: str | None = None,
) -> tuple[dict[str, Any], int, bytes]:
    """Serial: P first, then D with P's engine id, block ids and transfer id."""
    rid, tx = peer_request_id(p, d), f"tx-{uuid.uuid4()}"
    status, raw = await post(
        session, p.url + path, p_body(body, moriio_p_params(tx, d)), headers(rid, p_rank)
    )
    assert status == 200, raw
    returned = orjson.loads(raw)["kv_transfer_params"]
    params = moriio_d_params(tx, p, d_rank)
    params.update({k: returned[k] for k in ("remote_engine_id", "remote_block_ids", "transfer_id")})
    if transfer_id is not None:
        params["transfer_id"] = transfer_id
    status, raw = await post(
        session, d.url + path, {**body, "kv_transfer_params": params}, headers(rid)
    )
    return returned, status, raw


async def moriio_write(
    session: aiohttp.ClientSession,
    p: SimHandle,
    d: SimHandle,
    path: str,
    body: dict[str, Any],
    *,
    p_rank: int | None = None,
    d_rank: int | None = None,
    d_first_s: float = 0.0,
) -> tuple[int, bytes]:
    """Concurrent: P and D at once (D optionally `d_first_s` ahead of P)."""
    rid, tx = peer_request_id(p, d), f"tx-{uuid.uuid4()}"
    d_body = {**body, "kv_transfer_params": moriio_d_params(tx, p, d_rank)}
    d_task = asyncio.ensure_future(post(session, d.url + path, d_body, headers(rid)))
    await asyncio.sleep(d_first_s)
    p_status, p_raw = await post(
        session, p.url + path, p_body(body, moriio_p_params(tx, d)), headers(rid, p_rank)
    )
    assert p_status == 200, p_raw
    return await d_task


async def p2p(
    session: aiohttp.ClientSession,
    p: SimHandle,
    d: SimHandle,
    path: str,
    body: dict[str, Any],
    *,
    run_prefill: bool = True,
) -> tuple[int, bytes]:
    """Serial, no kv_transfer_params; the id names both peers."""
    rid = peer_request_id(p, d)
    if run_prefill:
        status, raw = await post(session, p.url + path, p_body(body, None), headers(rid))
        assert status == 200, raw
        assert (
            "kv_transfer_params" not in orjson.loads(raw)
            or not orjson.loads(raw)["kv_transfer_params"]
        )
    return await post(session, d.url + path, body, headers(rid))


async def mooncake(
    session: aiohttp.ClientSession,
    p: SimHandle,
    d: SimHandle,
    path: str,
    body: dict[str, Any],
    *,
    rank: int = 0,
    engine_id: str | None = None,
    p_transfer_id: bool = True,
) -> tuple[int, bytes]:
    """Concurrent: P fire-and-forget with X-data-parallel-rank, D streamed at once."""
    rid = uuid.uuid4().hex
    tx = f"xfer-{rid}"
    p_params: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}
    if p_transfer_id:
        p_params["transfer_id"] = tx
    d_params = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_bootstrap_addr": p.bootstrap_url,
        "remote_engine_id": engine_id or p.engine_ids[rank],
        "transfer_id": tx,
    }
    p_task = asyncio.ensure_future(
        post(session, p.url + path, p_body(body, p_params), headers(rid, rank))
    )
    d_result = await post(
        session, d.url + path, {**body, "kv_transfer_params": d_params}, headers(rid)
    )
    p_status, p_raw = await p_task
    assert p_status == 200, p_raw
    return d_result
