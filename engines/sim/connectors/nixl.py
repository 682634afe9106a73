"""NIXL-like pull connector: P holds blocks under a lease, D pulls them over the side channel.

P answers a `do_remote_decode` request with the kv_transfer_params of vLLM 0.33's
NixlConnector (PROTOCOLS.md 3.2). D, given those params verbatim, asks P's side channel for
(engine_id, remote_request_id, block_ids); any mismatch is an error and D recomputes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engines.sim import model
from engines.sim.connectors import ConnectorDeps, sidechannel
from engines.sim.openai_api import GenRequest

log = logging.getLogger("engines.sim.nixl")
PULL_TIMEOUT_S = 5.0
REQUIRED_D_PARAMS = (
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
)


@dataclass
class Held:
    block_ids: list[int]
    blocks: list[bytes]
    timer: asyncio.TimerHandle


class NixlConnector:
    bootstrap_port: int | None = None

    def __init__(self, deps: ConnectorDeps) -> None:
        self.cfg = deps.config
        self.counters = deps.counters
        self.pool = deps.pool
        self.kv_port = 0
        self._held: dict[str, Held] = {}
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await sidechannel.serve(self.cfg.kv_host, self.cfg.kv_port, self._serve)
        self.kv_port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        for rid in list(self._held):
            self._release(rid)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def held_blocks(self) -> int:
        return sum(len(h.block_ids) for h in self._held.values())

    # decode side
    def must_fetch(self, req: GenRequest) -> bool:
        return bool((req.kv_transfer_params or {}).get("do_remote_prefill"))

    def load_now(self, req: GenRequest) -> list[bytes] | None:
        return None

    async def fetch(self, req: GenRequest) -> list[bytes] | None:
        params = req.kv_transfer_params or {}
        missing = [k for k in REQUIRED_D_PARAMS if params.get(k) is None]
        if missing:
            log.warning(
                "Got invalid KVTransferParams %s (missing %s); will not utilize KVTransfer",
                params,
                missing,
            )
            self.counters.kv_invalid_params += 1
            return None
        try:
            reply = await sidechannel.request(
                str(params["remote_host"]),
                int(params["remote_port"]),
                _pull_msg(params),
                PULL_TIMEOUT_S,
            )
        except (OSError, asyncio.TimeoutError, ValueError, asyncio.IncompleteReadError) as exc:
            return self._failed(req, f"side channel: {exc!r}")
        if not reply.get("ok"):
            return self._failed(req, str(reply.get("error")))
        return self._loaded(req, reply.get("blocks") or [])

    def _loaded(self, req: GenRequest, blocks: list[bytes]) -> list[bytes] | None:
        kv = model.unpack_blocks(blocks)
        if len(kv) < len(req.prompt_tokens) - 1:
            return self._failed(
                req, f"got KV for {len(kv)} tokens, prompt has {len(req.prompt_tokens)}"
            )
        self.counters.kv_bytes_received += sum(len(b) for b in blocks)
        self.counters.kv_transfers += 1
        return kv

    def _failed(self, req: GenRequest, why: str) -> list[bytes] | None:
        log.warning("KV load failed for %s: %s; recomputing locally", req.internal_id, why)
        self.counters.kv_load_failures += 1
        return None

    # prefill side
    def finished(self, req: GenRequest, kv: Sequence[bytes]) -> dict[str, Any] | None:
        if not (req.kv_transfer_params or {}).get("do_remote_decode"):
            return None
        blocks = model.pack_blocks(kv, self.cfg.block_size)
        ids = self.pool.allocate(len(blocks))
        if ids is None:
            log.warning("no free KV blocks to hold %s for remote decode", req.internal_id)
            return None
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.cfg.kv_lease_s, self._expire, req.internal_id)
        self._held[req.internal_id] = Held(ids, blocks, timer)
        return self._params(req, ids)

    def _params(self, req: GenRequest, ids: list[int]) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [ids],
            "remote_engine_id": self.cfg.engine_id,
            "remote_request_id": req.internal_id,
            "remote_host": self.cfg.kv_host,
            "remote_port": self.kv_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": len(req.prompt_tokens),
            "remote_blocks_expiry_time": None,
            "remote_registration_generation": 0,
            "transfer_mode": "pull",
        }

    def _serve(self, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("engine_id") != self.cfg.engine_id:
            return {
                "ok": False,
                "error": f"engine_id {msg.get('engine_id')!r} is not {self.cfg.engine_id!r}",
            }
        rid = str(msg.get("request_id"))
        held = self._held.get(rid)
        if held is None:
            return {
                "ok": False,
                "error": f"Potentially invalid KV blocks for unrecognized request {rid}",
            }
        if list(msg.get("block_ids") or []) != held.block_ids:
            return {"ok": False, "error": f"block ids do not match request {rid}"}
        self._release(rid)
        self.counters.kv_bytes_sent += sum(len(b) for b in held.blocks)
        self.counters.kv_transfers += 1
        return {"ok": True, "blocks": held.blocks}

    def _expire(self, rid: str) -> None:
        log.info(
            "Releasing expired KV blocks for request %s retrieved by 0 remote worker(s) "
            "before lease expired",
            rid,
        )
        self.counters.kv_leases_expired += 1
        self._release(rid)

    def _release(self, rid: str) -> None:
        held = self._held.pop(rid, None)
        if held is not None:
            held.timer.cancel()
            self.pool.free(held.block_ids)


def _pull_msg(params: dict[str, Any]) -> dict[str, Any]:
    ids = params["remote_block_ids"]
    flat = ids[0] if ids and isinstance(ids[0], list) else ids
    return {
        "engine_id": params["remote_engine_id"],
        "request_id": params["remote_request_id"],
        "block_ids": flat,
    }
