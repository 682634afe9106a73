"""The membership owner's side of the workers' channel: snapshots out, control requests in.

PUB (``ipc://``, the run directory): the owner's whole membership as a numbered snapshot
(``pdproxy.membership.workers.snapshot``), published as soon as the registry changes (an addition, a
removal, a state or a health verdict, whatever fed it: the command line, ZMQ heartbeats, the
admin API or another registry backend), coalesced within one loop turn, and every
``period`` seconds whatever happened, which carries the figures that change without an event
(engine load, heartbeat times, probe counts) and heals a worker that missed a message.

ROUTER (``ipc://``): a worker's requests, each ``[request id, msgpack]``, answered in turn:
``snapshot`` (a joining worker's first state, so it never waits for the next publication),
``add`` and ``remove`` (the admin API's writes, applied by this process's ``Membership``,
then published before the answer, which carries the snapshot's number so the worker can wait
until it has applied it). An ``AdminError`` is answered with its status and message.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from pdproxy.config.workers import RunDir
from pdproxy.errors import AdminError
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.membership.membership import Membership
from pdproxy.membership.workers.snapshot import (
    EndpointRecord,
    Snapshot,
    address_from,
    encode_snapshot,
    pack,
    record_dict,
    snapshot_of,
    unpack,
)
from pdproxy.types import Endpoint, Role

logger = logging.getLogger(__name__)

_PERIOD = 1.0  # seconds between unconditional snapshots


class MembershipHub:
    def __init__(
        self,
        *,
        registry: EndpointRegistry,
        membership: Membership,
        run_dir: RunDir,
        backend: Callable[[], dict[str, Any]] | None = None,
        period: float = _PERIOD,
    ) -> None:
        self._registry = registry
        self._backend = backend  # the shared registry's status (--registry-backend etcd://)
        self._membership = membership
        self._run_dir = run_dir
        self._period = period
        self._context = zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._control: zmq.asyncio.Socket | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._dirty = False
        self.seq = 0

    def start(self) -> None:
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(self._run_dir.publish)
        self._control = self._context.socket(zmq.ROUTER)
        self._control.setsockopt(zmq.LINGER, 0)
        self._control.bind(self._run_dir.control)
        self._registry.on_change(self._changed)
        self._spawn(self._publish_forever())
        self._spawn(self._serve(self._control))

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for sock in (self._pub, self._control):
            if sock is not None:
                sock.close(linger=0)
        self._context.term()

    def publish(self) -> int:
        """Publish the membership now; returns the snapshot's number."""
        self._dirty = False
        self.seq += 1
        if self._pub is not None:
            raw = encode_snapshot(self._snapshot())
            self._pub.send(raw, flags=zmq.NOBLOCK)  # a PUB never blocks; slow peers drop
        return self.seq

    def _snapshot(self) -> Snapshot:
        backend = None if self._backend is None else self._backend()
        return snapshot_of(self.seq, self._registry.all(), backend)

    def _changed(self) -> None:
        if not self._dirty:
            self._dirty = True
            asyncio.get_running_loop().call_soon(self._publish_if_dirty)

    def _publish_if_dirty(self) -> None:
        if self._dirty:
            self.publish()

    async def _publish_forever(self) -> None:
        while True:
            await asyncio.sleep(self._period)
            try:
                self.publish()
            except Exception:  # the publisher must outlive any one bad round
                logger.exception("workers: publishing the membership failed")

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        """Receive forever; an unexpected error is logged and receiving resumes."""
        while True:
            try:
                frames = await sock.recv_multipart()
            except zmq.ZMQError:
                logger.exception("workers: the control socket failed; resuming")
                await asyncio.sleep(_PERIOD)
                continue
            if len(frames) != 3:
                logger.warning("workers: dropped a control message of %d frames", len(frames))
                continue
            peer, request_id, payload = frames
            self._spawn(self._answer(sock, peer, request_id, payload))

    async def _answer(
        self, sock: zmq.asyncio.Socket, peer: bytes, request_id: bytes, payload: bytes
    ) -> None:
        try:
            reply = await self.handle(unpack(payload))
        except AdminError as exc:
            reply = {"ok": False, "status": exc.status, "error": str(exc)}
        except (KeyError, TypeError, ValueError) as exc:
            logger.warning("workers: malformed control request: %r", exc)
            reply = {"ok": False, "status": 400, "error": "malformed control request"}
        except Exception:
            logger.exception("workers: control request failed")
            reply = {"ok": False, "status": 500, "error": "the membership owner failed"}
        await sock.send_multipart([peer, request_id, pack(reply)])

    async def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request["op"]
        if op == "snapshot":
            self.seq += 1
            raw = encode_snapshot(self._snapshot())
            return {"ok": True, "seq": self.seq, "snapshot": raw}
        endpoint: Endpoint
        if op == "add":
            role = Role(request["role"])
            endpoint = await self._membership.add_admin(role, address_from(request["address"]))
        elif op == "remove":
            endpoint = self._membership.drain(str(request["url"]))
        else:
            raise ValueError(f"unknown op {op!r}")
        # Published before the answer: the asking worker waits for this number.
        return {
            "ok": True,
            "seq": self.publish(),
            "endpoint": record_dict(EndpointRecord.of(endpoint)),
        }

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
