"""NIXL-like pull connector: P holds blocks under a lease, D pulls them over the side channel.

P answers a `do_remote_decode` request with the kv_transfer_params of vLLM 0.33's
NixlConnector (PROTOCOLS.md 3.2). D, given those params verbatim, asks P's side channel for
(engine_id, remote_request_id, block_ids); any mismatch is an error and D recomputes.

A decode that the handler rejects before admission (vLLM 0.32's
`notify_kv_transfer_request_rejected`) makes D send P a `release` notice, but only for a P
engine D has already pulled from since it started: vLLM's idle decode never steps again to
handshake with a new P, so a cold pair leaves the blocks to P's lease.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engines.sim import model
from engines.sim.connectors import ConnectorDeps, sidechannel
from engines.sim.errors import EngineDeadError
from engines.sim.openai_api import GenRequest

log = logging.getLogger("engines.sim.nixl")
PULL_TIMEOUT_S = 5.0
NOTICE_TIMEOUT_S = 5.0
UNKNOWN = "Potentially invalid KV blocks for unrecognized request %s"
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
        self._handshaked: set[str] = set()  # P engine ids pulled from since start
        self._notices: set[asyncio.Task[None]] = set()
        self._stopping = False

    async def start(self) -> None:
        self._server = await sidechannel.serve(self.cfg.kv_host, self.cfg.kv_port, self._serve)
        self.kv_port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self._stopping = True
        for task in list(self._notices):
            task.cancel()
        await asyncio.gather(*self._notices, return_exceptions=True)
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
        self._check_blocks(req, params)
        try:
            reply = await sidechannel.request(
                str(params["remote_host"]),
                int(params["remote_port"]),
                _pull_msg(params),
                PULL_TIMEOUT_S,
            )
        except sidechannel.ERRORS as exc:
            return self._failed(req, f"side channel: {exc!r}")
        if not reply.get("ok"):
            return self._failed(req, str(reply.get("error")))
        kv = self._loaded(req, reply.get("blocks") or [])
        if kv is not None:
            self._handshaked.add(str(params["remote_engine_id"]))
        return kv

    def _check_blocks(self, req: GenRequest, params: dict[str, Any]) -> None:
        """vLLM 0.32's NIXL worker asserts that the decode allocated no more blocks for the
        prompt than the prefill lists (``_apply_prefix_caching``), and the engine core dies:
        a prompt one token longer than the prefill's, at a multiple of the block size."""
        needed = -(-len(req.prompt_tokens) // self.cfg.block_size)
        listed = len(_pull_msg(params)["block_ids"])
        if needed > listed:
            raise EngineDeadError(
                f"AssertionError in the NIXL worker: {needed} decode blocks for request"
                f" {req.internal_id}, the prefill listed {listed}"
            )

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

    def reject(self, params: dict[str, Any]) -> None:
        """Tell a warm P to free a rejected request's blocks; never waits, never raises."""
        if self._stopping or not params.get("do_remote_prefill"):
            return
        engine_id = str(params.get("remote_engine_id"))
        if engine_id not in self._handshaked:
            log.debug("no handshake with P engine %s yet: its lease frees the blocks", engine_id)
            return
        notice = _release_msg(params)
        if notice is None:
            return
        task = asyncio.get_running_loop().create_task(self._notify(*notice))
        self._notices.add(task)
        task.add_done_callback(self._notices.discard)

    async def _notify(self, host: str, port: int, msg: dict[str, Any]) -> None:
        try:
            reply = await sidechannel.request(host, port, msg, NOTICE_TIMEOUT_S)
        except sidechannel.ERRORS as exc:
            log.warning(
                "release notice for %s to %s:%d failed: %r", msg["request_id"], host, port, exc
            )
            return
        if not reply.get("ok"):
            log.warning("release notice for %s refused: %s", msg["request_id"], reply.get("error"))

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
        op = msg.get("op")
        if op == "release":
            return self._release_rejected(rid)
        if op is not None:
            return {"ok": False, "error": f"unsupported op {op!r}"}
        return self._pull(rid, msg)

    def _pull(self, rid: str, msg: dict[str, Any]) -> dict[str, Any]:
        held = self._held.get(rid)
        if held is None:
            return {"ok": False, "error": UNKNOWN % rid}
        if list(msg.get("block_ids") or []) != held.block_ids:
            return {"ok": False, "error": f"block ids do not match request {rid}"}
        self._release(rid)
        self.counters.kv_bytes_sent += sum(len(b) for b in held.blocks)
        self.counters.kv_transfers += 1
        return {"ok": True, "blocks": held.blocks}

    def _release_rejected(self, rid: str) -> dict[str, Any]:
        """A decode rejected the request: free its blocks now rather than at the lease."""
        if rid not in self._held:
            log.error(UNKNOWN, rid)  # already pulled, expired or released
            self.counters.kv_release_unknown += 1
            return {"ok": False, "error": UNKNOWN % rid}
        log.info("Releasing KV blocks for request %s rejected by the remote decode", rid)
        self.counters.kv_released_on_reject += 1
        self._release(rid)
        return {"ok": True}

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


def _release_msg(params: dict[str, Any]) -> tuple[str, int, dict[str, Any]] | None:
    """(host, port, frame) of the release notice for P's params, or None if they lack it."""
    host, port, rid = (params.get(k) for k in ("remote_host", "remote_port", "remote_request_id"))
    if host is None or rid is None or type(port) is not int:
        return None
    msg = {"op": "release", "engine_id": params["remote_engine_id"], "request_id": rid}
    return str(host), port, msg
