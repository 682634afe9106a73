"""MoRIIO-like connector (vLLM 0.33, PROTOCOLS.md 2.2): READ pulls, WRITE pushes, by transfer_id.

* **READ (serial).** P holds the prompt's blocks under its request's `transfer_id` and the
  DP rank it ran on, and answers MoRIIO's P params. D finds P from the request id
  (`_PREFILL_ZMQ_RE`, falling back to `remote_host`/`remote_handshake_port`) and reads the
  blocks by `transfer_id` over P's side channel (the "handshake" port). Any mismatch
  (transfer id, DP rank, engine id, block ids) is a load failure and D recomputes.
* **WRITE (concurrent).** After prefilling, P pushes the blocks to D's notify address taken
  from the request id (`_DECODE_ZMQ_RE`), keyed by `transfer_id` and P's DP rank. D waits
  up to `kv_wait_timeout_s` for the parcel of (`transfer_id`, `remote_dp_rank`); a push
  that lands on another rank never arrives (MoRIIO's notify-to-rank-0 bug), and the timeout
  fails the request.

A decode without `transfer_id` uses `sidecar-<request id>`, which never matches (as vLLM).
One side channel serves both the handshake and the notify port of every DP rank.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from engines.sim import model
from engines.sim.connectors import ids, sidechannel
from engines.sim.connectors.transfer import (
    EXCHANGE_TIMEOUT_S,
    SIDE_CHANNEL_ERRORS,
    SideChannelConnector,
    accept_kv,
    load_failed,
    wait_failed,
)
from engines.sim.openai_api import GenRequest

log = logging.getLogger("engines.sim.moriio")


def _transfer_id(req: GenRequest) -> str:
    return str((req.kv_transfer_params or {}).get("transfer_id") or f"sidecar-{req.internal_id}")


def _rank_key(transfer_id: str, rank: int) -> str:
    return f"{transfer_id}#{rank}"


class MoriioConnector(SideChannelConnector):
    # decode side
    def must_fetch(self, req: GenRequest) -> bool:
        return bool((req.kv_transfer_params or {}).get("do_remote_prefill"))

    async def fetch(self, req: GenRequest) -> list[bytes] | None:
        params = req.kv_transfer_params or {}
        if "transfer_id" not in params:
            log.warning("kv_transfer_params without transfer_id for %s", req.internal_id)
        rank = int(params.get("remote_dp_rank") or 0)
        if self.cfg.transfer_mode == "WRITE":
            return await self._await_push(req, _transfer_id(req), rank)
        return await self._read(req, params, rank)

    async def _await_push(self, req: GenRequest, transfer_id: str, rank: int) -> list[bytes]:
        key = _rank_key(transfer_id, rank)
        timeout = self.cfg.kv_wait_timeout_s
        parcel = await self.mailbox.ready(key, timeout)
        if parcel is None:
            raise wait_failed(req, self.counters, f"no KV written for {key} in {timeout:g} s")
        self.mailbox.take(key)
        kv = accept_kv(req, parcel.blocks, self.counters)
        if kv is None:
            raise wait_failed(req, self.counters, f"short KV written for {key}")
        return kv

    async def _read(self, req: GenRequest, params: dict[str, Any], rank: int) -> list[bytes] | None:
        peer = _prefill_peer(req, params)
        if peer is None:
            return load_failed(req, self.counters, "no prefill address in id or params")
        msg = {
            "op": "read",
            "transfer_id": _transfer_id(req),
            "dp_rank": rank,
            "engine_id": params.get("remote_engine_id"),
            "block_ids": params.get("remote_block_ids"),
        }
        try:
            reply = await sidechannel.request(*peer, msg, EXCHANGE_TIMEOUT_S)
        except SIDE_CHANNEL_ERRORS as exc:
            return load_failed(req, self.counters, f"side channel {peer}: {exc!r}")
        if not reply.get("ok"):
            return load_failed(req, self.counters, str(reply.get("error")))
        return accept_kv(req, reply.get("blocks") or [], self.counters)

    # prefill side
    def finished(self, req: GenRequest, kv: Sequence[bytes]) -> dict[str, Any] | None:
        params = req.kv_transfer_params or {}
        if not params.get("do_remote_decode"):
            return None
        transfer_id, rank = _transfer_id(req), req.dp_rank or 0
        blocks = model.pack_blocks(kv, self.cfg.block_size)
        if self.cfg.transfer_mode == "WRITE":
            self._write(req, transfer_id, rank, blocks)
            return self._params(transfer_id, rank, [])
        ids_ = self.mailbox.put(transfer_id, blocks, {"dp_rank": rank})
        if ids_ is None:
            return None
        return self._params(transfer_id, rank, ids_)

    def _write(self, req: GenRequest, transfer_id: str, rank: int, blocks: list[bytes]) -> None:
        peer = ids.moriio_peer(req.internal_id, prefill=False)
        if peer is None:
            log.warning("no decode address in request id %s; KV not written", req.internal_id)
            return
        msg = {"op": "write", "transfer_id": transfer_id, "dp_rank": rank, "blocks": blocks}
        self.spawn_send(peer["host"], int(peer["notify"]), msg, transfer_id)

    def _params(self, transfer_id: str, rank: int, block_ids: list[int]) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": block_ids,
            "remote_engine_id": self.cfg.engine_ids[rank],
            "remote_host": self.cfg.kv_host,
            "remote_handshake_port": self.kv_port,
            "remote_notify_port": self.kv_port,
            "remote_dp_rank": rank,
            "remote_dp_rank_override": True,
            "remote_dp_size": self.cfg.dp_size,
            "remote_dp_size_local": self.cfg.dp_size,
            "tp_size": self.cfg.tp_size,
            "transfer_id": transfer_id,
        }

    # side channel: D reads from P (READ), P writes to D (WRITE)
    async def serve(self, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("op") == "write":
            key = _rank_key(str(msg.get("transfer_id")), int(msg.get("dp_rank") or 0))
            if self.mailbox.put(key, list(msg.get("blocks") or []), {}) is None:
                return {"ok": False, "error": "no free KV blocks"}
            return {"ok": True}
        if msg.get("op") == "read":
            return self._serve_read(msg)
        return await super().serve(msg)

    def _serve_read(self, msg: dict[str, Any]) -> dict[str, Any]:
        transfer_id = str(msg.get("transfer_id"))
        parcel = self.mailbox.peek(transfer_id)
        if parcel is None:
            return {"ok": False, "error": f"no KV held for transfer {transfer_id}"}
        rank = int(parcel.meta["dp_rank"])
        if msg.get("dp_rank") != rank:
            return {
                "ok": False,
                "error": f"transfer {transfer_id} ran on dp rank {rank}, not {msg.get('dp_rank')}",
            }
        engine_id = msg.get("engine_id")
        if engine_id is not None and engine_id != self.cfg.engine_ids[rank]:
            return {"ok": False, "error": f"engine_id {engine_id!r} is not this engine's"}
        block_ids = msg.get("block_ids")
        if block_ids and list(block_ids) != parcel.block_ids:
            return {"ok": False, "error": f"block ids do not match transfer {transfer_id}"}
        self.mailbox.take(transfer_id)
        self.sent_from(parcel)
        return {"ok": True, "blocks": parcel.blocks}


def _prefill_peer(req: GenRequest, params: dict[str, Any]) -> tuple[str, int] | None:
    peer = ids.moriio_peer(req.internal_id, prefill=True)
    if peer is not None:
        return peer["host"], int(peer["handshake"])
    host, port = params.get("remote_host"), params.get("remote_handshake_port")
    if host and port:
        return str(host), int(port)
    return None
