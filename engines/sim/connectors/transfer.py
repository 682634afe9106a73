"""Machinery shared by the id-embedding connectors (MoRIIO, P2P-NCCL, Mooncake).

* `Mailbox`: KV parcels keyed by a transfer key, held in pool blocks under a lease, with
  waiters (a decode waiting for a push, a pull waiting for a concurrent prefill).
* `SideChannelConnector`: one side-channel server per engine, the mailbox, background
  pushes; subclasses answer side-channel ops and decide per request.
* `accept_kv`, `send`: count a loaded or sent parcel in the engine's counters.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engines.sim import model
from engines.sim.connectors import ConnectorDeps, sidechannel
from engines.sim.errors import KVTransferError
from engines.sim.kvstore import BlockPool
from engines.sim.metrics import Counters
from engines.sim.openai_api import GenRequest

log = logging.getLogger("engines.sim.transfer")
EXCHANGE_TIMEOUT_S = 5.0  # one side-channel round trip (beyond any wait the peer is asked for)
SIDE_CHANNEL_ERRORS = (OSError, asyncio.TimeoutError, ValueError, asyncio.IncompleteReadError)


@dataclass
class Parcel:
    blocks: list[bytes]
    meta: dict[str, Any]
    block_ids: list[int]
    timer: asyncio.TimerHandle | None = None

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.blocks)


@dataclass
class Mailbox:
    """Parcels by key; `put` wakes waiters, unclaimed parcels expire after `lease_s`."""

    pool: BlockPool
    counters: Counters
    lease_s: float
    _parcels: dict[str, Parcel] = field(default_factory=dict)
    _waiters: dict[str, list[asyncio.Future[None]]] = field(default_factory=dict)

    def put(self, key: str, blocks: list[bytes], meta: dict[str, Any]) -> list[int] | None:
        """Hold a parcel; None when the pool is full (nothing is held)."""
        self.drop(key)
        ids = self.pool.allocate(len(blocks))
        if ids is None:
            log.warning("no free KV blocks to hold %s", key)
            return None
        timer = asyncio.get_running_loop().call_later(self.lease_s, self._expire, key)
        self._parcels[key] = Parcel(blocks, meta, ids, timer)
        for fut in self._waiters.pop(key, []):
            if not fut.done():
                fut.set_result(None)
        return ids

    def peek(self, key: str) -> Parcel | None:
        return self._parcels.get(key)

    def take(self, key: str) -> Parcel | None:
        parcel = self._parcels.pop(key, None)
        if parcel is not None:
            if parcel.timer is not None:
                parcel.timer.cancel()
            self.pool.free(parcel.block_ids)
        return parcel

    async def ready(self, key: str, timeout: float) -> Parcel | None:
        """Wait until `key` is held (or `timeout` passes); the parcel stays held."""
        if key in self._parcels:
            return self._parcels[key]
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(key, []).append(fut)
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            waiters = self._waiters.get(key)
            if waiters is not None and fut in waiters:
                waiters.remove(fut)
                if not waiters:
                    del self._waiters[key]
        return self._parcels.get(key)

    def drop(self, key: str) -> None:
        self.take(key)

    def held_blocks(self) -> int:
        return sum(len(p.block_ids) for p in self._parcels.values())

    def close(self) -> None:
        for key in list(self._parcels):
            self.take(key)
        for waiters in self._waiters.values():
            for fut in waiters:
                fut.cancel()
        self._waiters.clear()

    def _expire(self, key: str) -> None:
        log.info("Releasing expired KV blocks for transfer %s (never claimed)", key)
        self.counters.kv_leases_expired += 1
        self.take(key)


def accept_kv(req: GenRequest, blocks: Sequence[bytes], counters: Counters) -> list[bytes] | None:
    """Unpack loaded blocks and count the load; None (and a load failure) if too short."""
    kv = model.unpack_blocks(list(blocks))
    if len(kv) < len(req.prompt_tokens) - 1:
        return load_failed(
            req, counters, f"got KV for {len(kv)} tokens, prompt has {len(req.prompt_tokens)}"
        )
    counters.kv_bytes_received += sum(len(b) for b in blocks)
    counters.kv_transfers += 1
    return kv


def load_failed(req: GenRequest, counters: Counters, why: str) -> list[bytes] | None:
    """Count a failed load; always None, so D recomputes locally."""
    log.warning("KV load failed for %s: %s; recomputing locally", req.internal_id, why)
    counters.kv_load_failures += 1
    return None


def wait_failed(req: GenRequest, counters: Counters, why: str) -> KVTransferError:
    """A decode that cannot be served without its KV: count it and build the error."""
    log.error("KV transfer failed for %s: %s", req.internal_id, why)
    counters.kv_load_failures += 1
    return KVTransferError(f"KV transfer failed for request {req.internal_id}: {why}")


class SideChannelConnector:
    """Base of the id-embedding connectors: side channel, mailbox, background sends."""

    bootstrap_port: int | None = None

    def __init__(self, deps: ConnectorDeps) -> None:
        self.cfg = deps.config
        self.counters = deps.counters
        self.pool = deps.pool
        self.kv_port = 0
        self.mailbox = Mailbox(deps.pool, deps.counters, deps.config.kv_lease_s)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await sidechannel.serve(self.cfg.kv_host, self.cfg.kv_port, self.serve)
        self.kv_port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.mailbox.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    def held_blocks(self) -> int:
        return self.mailbox.held_blocks()

    def load_now(self, req: GenRequest) -> list[bytes] | None:
        return None

    def reject(self, params: dict[str, Any]) -> None:
        return None  # vLLM's notify on rejection is NIXL's alone; P holds until the lease

    async def serve(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Answer one side-channel frame (subclasses)."""
        return {"ok": False, "error": f"unsupported op {msg.get('op')!r}"}

    def spawn_send(self, host: str, port: int, msg: dict[str, Any], what: str) -> None:
        """Push a parcel in the background (the P response does not wait for it)."""
        task = asyncio.get_running_loop().create_task(self._send(host, port, msg, what))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, host: str, port: int, msg: dict[str, Any], what: str) -> None:
        try:
            reply = await sidechannel.request(host, port, msg, EXCHANGE_TIMEOUT_S)
        except SIDE_CHANNEL_ERRORS as exc:
            log.warning("KV push of %s to %s:%d failed: %r", what, host, port, exc)
            return
        if not reply.get("ok"):
            log.warning("KV push of %s refused by %s:%d: %s", what, host, port, reply.get("error"))
            return
        self.counters.kv_bytes_sent += sum(len(b) for b in msg.get("blocks") or [])
        self.counters.kv_transfers += 1

    def sent_from(self, parcel: Parcel) -> None:
        """Count a parcel that a peer pulled."""
        self.counters.kv_bytes_sent += parcel.nbytes
        self.counters.kv_transfers += 1
