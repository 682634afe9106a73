"""NIXL-like push connector (vLLM 0.32's ``NixlPushConnector``): D registers, P writes.

A decode request with ``do_remote_prefill`` keeps its prompt's blocks from admission and
registers with the prefill named by its params over the side channel (``push_reg``, with its
own side channel); the prefill writes the blocks back to the decode's side channel
(``write``) when a request it finished normally matches the registration: by the exact
internal id, else by the id less its random ``-<8 hex>`` suffix, first match first (so the
same ``X-Request-Id`` and the same endpoint family are needed, and two requests sharing an
id may swap their KV). What vLLM 0.32 does, and the sim with it:

* a decode missing ``remote_engine_id``, ``remote_host``, ``remote_port``, ``tp_size`` or
  ``remote_request_id`` kills the engine (a ``KeyError`` in vLLM's scheduler);
* a registration the prefill refuses (another engine id) or cannot be reached for, on the
  first contact with that engine id, fails the request at once (``kv_load_failure_policy``
  fail); after a first contact the decode keeps the agent it met, so a prefill restarted
  under the same engine id gets nothing and the decode waits for ever;
* a registration that matches nothing is parked on the prefill with no expiry; the finished
  blocks it could have matched expire at the lease (``kv_lease_s``);
* the decode waits with no deadline (``push_registration_timeout`` only logs);
* a decode request aborted while it waits keeps its blocks (they count in
  ``kv_cache_usage_perc``) until its write arrives, or the engine restarts;
* a decode needing more blocks than the prefill finished makes the prefill's writer assert
  (logged): both are dropped and the decode waits for ever (pull kills the decode instead);
* a prefill request that did not finish normally (aborted) pushes nothing.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engines.sim import model
from engines.sim.connectors import ConnectorDeps, sidechannel
from engines.sim.connectors.ids import base_request_id
from engines.sim.errors import EngineDeadError, KVTransferError
from engines.sim.openai_api import GenRequest

log = logging.getLogger("engines.sim.nixl_push")
HANDSHAKE_TIMEOUT_S = 5.0  # vLLM's side-channel RCVTIMEO
REQUIRED_D_PARAMS = ("remote_engine_id", "remote_host", "remote_port", "tp_size")


@dataclass
class Finished:
    """A prefill's finished request, its blocks held for a registration until the lease."""

    request_id: str
    block_ids: list[int]
    blocks: list[bytes]
    timer: asyncio.TimerHandle


@dataclass(frozen=True)
class Registration:
    """A decode's registration: where to write, and how many blocks it allocated."""

    request_id: str
    blocks_needed: int
    host: str
    port: int


class NixlPushConnector:
    bootstrap_port: int | None = None

    def __init__(self, deps: ConnectorDeps) -> None:
        self.cfg = deps.config
        self.counters = deps.counters
        self.pool = deps.pool
        self.kv_port = 0
        self.generation = uuid.uuid4().hex  # this start's agent: a restart is another
        self._server: asyncio.Server | None = None
        self._finished: dict[str, Finished] = {}  # P: by internal id, in finishing order
        self._parked: list[Registration] = []  # P: registrations no finished request matched
        self._agents: dict[str, tuple[str, int, str]] = {}  # D: engine id -> agent met first
        self._pending: dict[str, asyncio.Future[list[bytes]]] = {}  # D: awaited writes
        self._leaked = 0  # D: blocks of aborted requests still waiting for their write
        self._writes: set[asyncio.Task[None]] = set()  # P: writes under way

    async def start(self) -> None:
        self._server = await sidechannel.serve(self.cfg.kv_host, self.cfg.kv_port, self._serve)
        self.kv_port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        for task in list(self._writes):
            task.cancel()
        await asyncio.gather(*self._writes, return_exceptions=True)
        for waiting in self._pending.values():
            waiting.cancel()
        for rid in list(self._finished):
            self._drop(rid)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def held_blocks(self) -> int:
        return sum(len(f.block_ids) for f in self._finished.values()) + self._leaked

    # decode side
    def must_fetch(self, req: GenRequest) -> bool:
        return bool((req.kv_transfer_params or {}).get("do_remote_prefill"))

    def load_now(self, req: GenRequest) -> list[bytes] | None:
        return None

    async def fetch(self, req: GenRequest) -> list[bytes] | None:
        params = req.kv_transfer_params or {}
        missing = [k for k in (*REQUIRED_D_PARAMS, "remote_request_id") if k not in params]
        if missing:
            raise EngineDeadError(f"KeyError: {missing[0]!r} in the push scheduler")
        engine_id = str(params["remote_engine_id"])
        host, port, generation = await self._agent(
            engine_id, str(params["remote_host"]), params["remote_port"]
        )
        blocks_needed = -(-len(req.prompt_tokens) // self.cfg.block_size)
        waiting = self._pending[req.internal_id] = asyncio.get_running_loop().create_future()
        msg = {
            "op": "push_reg",
            "engine_id": engine_id,
            "generation": generation,
            "request_id": req.internal_id,
            "blocks_needed": blocks_needed,
            "decode_host": self.cfg.kv_host,
            "decode_port": self.kv_port,
        }
        try:
            reply = await sidechannel.request(host, port, msg, HANDSHAKE_TIMEOUT_S)
        except sidechannel.ERRORS as exc:
            # vLLM only logs a notification it could not send: the request waits for ever.
            log.warning("push registration for %s not sent: %r", req.internal_id, exc)
            reply = {"ok": True}
        if not reply.get("ok"):
            self._pending.pop(req.internal_id, None)
            raise KVTransferError(f"push registration refused: {reply.get('error')}")
        try:
            blocks = await asyncio.shield(waiting)
        except asyncio.CancelledError:
            if not waiting.done():
                self._leak(req.internal_id, waiting, blocks_needed)
            raise
        return self._loaded(req, blocks)

    async def _agent(self, engine_id: str, host: str, port: Any) -> tuple[str, int, str]:
        """The prefill agent for ``engine_id``: the one met first (vLLM keeps it, even when
        the prefill restarted under the same id), else a handshake that must succeed."""
        known = self._agents.get(engine_id)
        if known is not None:
            return known
        try:
            reply = await sidechannel.request(
                host, int(port), {"op": "handshake", "engine_id": engine_id}, HANDSHAKE_TIMEOUT_S
            )
        except (*sidechannel.ERRORS, TypeError) as exc:
            raise KVTransferError(f"push handshake with {engine_id} failed: {exc!r}") from exc
        if not reply.get("ok"):
            raise KVTransferError(f"push handshake failed: {reply.get('error')}")
        agent = (host, int(port), str(reply["generation"]))
        self._agents[engine_id] = agent
        return agent

    def _leak(self, rid: str, waiting: asyncio.Future[list[bytes]], blocks: int) -> None:
        """An aborted request that waits for its write keeps its blocks until it comes."""
        log.info("aborted request %s waiting for its push keeps %d blocks", rid, blocks)
        self._leaked += blocks

        def freed(_: asyncio.Future[list[bytes]]) -> None:
            self._leaked -= blocks

        waiting.add_done_callback(freed)

    def _written(self, msg: dict[str, Any]) -> dict[str, Any]:
        waiting = self._pending.pop(str(msg.get("request_id")), None)
        if waiting is None or waiting.done():
            return {"ok": False, "error": f"no request {msg.get('request_id')!r} waits here"}
        blocks = msg.get("blocks")
        waiting.set_result(list(blocks or ()))
        return {"ok": True}

    def _loaded(self, req: GenRequest, blocks: list[bytes]) -> list[bytes] | None:
        kv = model.unpack_blocks(blocks)
        self.counters.kv_bytes_received += sum(len(b) for b in blocks)
        self.counters.kv_transfers += 1
        if len(kv) < len(req.prompt_tokens) - 1:
            # A decode prompt longer than the prefill's (within its blocks): the tail is
            # recomputed; a shorter one takes the prefill's tail, silently wrong.
            log.warning("push for %s carried %d tokens of KV", req.internal_id, len(kv))
        return kv

    def reject(self, params: dict[str, Any]) -> None:
        """A decode refused before admission registers nothing: P's lease frees its blocks."""
        return

    # prefill side
    def finished(self, req: GenRequest, kv: Sequence[bytes]) -> dict[str, Any] | None:
        if not (req.kv_transfer_params or {}).get("do_remote_decode"):
            return None
        blocks = model.pack_blocks(kv, self.cfg.block_size)
        ids = self.pool.allocate(len(blocks))
        if ids is None:
            log.warning("no free KV blocks to hold %s for a push", req.internal_id)
            return None
        rid = req.internal_id
        timer = asyncio.get_running_loop().call_later(self.cfg.kv_lease_s, self._expire, rid)
        done = self._finished[rid] = Finished(rid, ids, blocks, timer)
        registration = _match(self._parked, rid)
        if registration is not None:
            self._parked.remove(registration)
            self._write(registration, done)
        return self._params(req, ids)

    def _params(self, req: GenRequest, ids: list[int]) -> dict[str, Any]:
        rank = req.dp_rank or 0
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": ids,
            "remote_engine_id": self.cfg.engine_ids[rank],
            "remote_request_id": req.internal_id,
            "remote_host": self.cfg.kv_host,
            "remote_port": self.kv_port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": len(req.prompt_tokens),
            "transfer_mode": "push",
        }

    def _serve(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "write":
            return self._written(msg)
        if msg.get("engine_id") not in self.cfg.engine_ids:
            return {"ok": False, "error": f"Remote NIXL agent engine ID mismatch: {msg}"}
        if op == "handshake":
            return {"ok": True, "generation": self.generation}
        if op != "push_reg":
            return {"ok": False, "error": f"unsupported op {op!r}"}
        if msg.get("generation") != self.generation:
            return {"ok": True}  # for an earlier start's agent: this one never hears of it
        registration = Registration(
            str(msg.get("request_id")),
            int(msg.get("blocks_needed") or 0),
            str(msg.get("decode_host")),
            int(msg.get("decode_port") or 0),
        )
        done = _match(list(self._finished.values()), registration.request_id)
        if done is None:
            self._parked.append(registration)  # no expiry, as vLLM's
        else:
            self._write(registration, done)
        return {"ok": True}

    def _write(self, registration: Registration, done: Finished) -> None:
        """Write ``done``'s blocks into the decode that registered (its blocks freed here)."""
        self._finished.pop(done.request_id)
        done.timer.cancel()
        self.pool.free(done.block_ids)
        blocks: list[bytes] | None = done.blocks
        if registration.blocks_needed > len(done.block_ids):
            log.error(
                "nixl-push-writer error; continuing: AssertionError: %d decode blocks for %s,"
                " the prefill finished %d",
                registration.blocks_needed,
                registration.request_id,
                len(done.block_ids),
            )
            return  # nothing is written: the decode waits for ever
        self.counters.kv_bytes_sent += sum(len(b) for b in done.blocks)
        self.counters.kv_transfers += 1
        msg = {"op": "write", "request_id": registration.request_id, "blocks": blocks}
        task = asyncio.get_running_loop().create_task(self._send(registration, msg))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def _send(self, registration: Registration, msg: dict[str, Any]) -> None:
        try:
            await sidechannel.request(registration.host, registration.port, msg, 5.0)
        except sidechannel.ERRORS as exc:
            log.warning("push write for %s failed: %r", registration.request_id, exc)

    def _expire(self, rid: str) -> None:
        log.info("Releasing expired KV blocks for request %s (no registration)", rid)
        self.counters.kv_leases_expired += 1
        self._drop(rid)

    def _drop(self, rid: str) -> None:
        done = self._finished.pop(rid, None)
        if done is not None:
            done.timer.cancel()
            self.pool.free(done.block_ids)


def _match(items: list[Any], request_id: str) -> Any:
    """vLLM's matching: the exact id first, then the id less its random suffix."""
    for item in items:
        if item.request_id == request_id:
            return item
    base = base_request_id(request_id)
    for item in items:
        if base_request_id(item.request_id) == base:
            return item
    return None
