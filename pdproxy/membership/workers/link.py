"""A worker's side of the channel to the membership owner (``pdproxy.membership.workers.hub``).

The worker's registry is a follower: its instances, their admission state, the active health
verdict and the engines' load figures come from the owner's snapshots; in-flight legs,
passive health (outlier ejection from this worker's own legs) and measured speed stay the
worker's own, on the same ``Endpoint`` objects, which a snapshot updates in place. An
instance the owner no longer lists leaves at once, or, while this worker still has legs on
it, turns DRAINING here and leaves with its last leg (its next snapshot, at most a second on).

Start-up asks the owner for a snapshot over the control socket (no waiting for the next
publication, no slow-joiner gap), then follows the PUB socket with ``CONFLATE`` (only the
newest snapshot counts; an older or repeated number is ignored). The admin API's writes go to
the owner over the control socket; the answer is given once this worker has applied the
snapshot that carries the write, so the next request on this worker already sees it.

The owner's probe verdicts and load figures are handed to the same owners a single process
uses: the health book (``OutlierDetector.on_published_probe``: an instance that recovers from
unhealthy starts with a clean record, one whose probes failed while this worker had it
ejected and that answers again, a restart, ends its ejection at once) and the load
scraper's ``apply_load``; this link writes no record itself.

When the supervisor is gone (its pid is no longer the parent) the worker signals itself
SIGTERM, which drains it like an operator's SIGTERM.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
from typing import Any

import zmq
import zmq.asyncio

from pdproxy.config.workers import WorkerSpec
from pdproxy.errors import AdminError
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.membership.identity import reidentify
from pdproxy.membership.load_scraper import apply_load
from pdproxy.membership.workers.snapshot import (
    EndpointRecord,
    Snapshot,
    address_dict,
    decode_snapshot,
    pack,
    record_from,
    unpack,
)
from pdproxy.resilience.outlier import OutlierDetector
from pdproxy.types import Endpoint, EndpointState, EngineAddress, Role

logger = logging.getLogger(__name__)

_START_TIMEOUT = 10.0  # seconds for the owner's first snapshot
_PARENT_POLL = 0.5  # seconds between checks that the supervisor is alive


class OwnerLink:
    def __init__(
        self,
        spec: WorkerSpec,
        *,
        registry: EndpointRegistry,
        outliers: OutlierDetector,
        max_age: float,
        admin_timeout: float,
    ) -> None:
        self.spec = spec
        self._registry = registry
        self._outliers = outliers
        self._max_age = max_age  # how long an engine's load figures are trusted
        self._admin_timeout = admin_timeout
        self._context = zmq.asyncio.Context()
        self._control: zmq.asyncio.Socket | None = None
        self._ids = itertools.count(1)
        self._answers: dict[bytes, asyncio.Future[dict[str, Any]]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._applied = asyncio.Event()
        self.seq = 0
        self.backend: dict[str, Any] | None = None  # the owner's shared-registry status

    def backend_status(self) -> dict[str, Any]:
        """The shared registry's status as the owner last published it (for /status)."""
        return self.backend or {"backend": "in-process", "up": True}

    async def start(self) -> None:
        control = self._context.socket(zmq.DEALER)
        control.setsockopt(zmq.LINGER, 0)
        control.connect(self.spec.run_dir.control)
        self._control = control
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.CONFLATE, 1)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(self.spec.run_dir.publish)
        self._tasks = [
            asyncio.create_task(self._read_answers(control)),
            asyncio.create_task(self._follow(sub)),
            asyncio.create_task(self._watch_parent()),
        ]
        answer = await self._ask({"op": "snapshot"}, _START_TIMEOUT)
        self.apply(decode_snapshot(answer["snapshot"]))
        logger.info(
            "worker %d/%d (pid %d) follows the membership: %d instance(s)",
            self.spec.index + 1,
            self.spec.count,
            os.getpid(),
            len(self._registry),
        )

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for future in self._answers.values():
            future.cancel()
        self._context.destroy(linger=0)

    # -- the admin API's writes --------------------------------------------------------

    async def add_admin(self, role: Role, address: EngineAddress) -> Endpoint:
        """The owner admits the instance; raises its ``AdminError`` (409, 400...)."""
        request = {"op": "add", "role": role.value, "address": address_dict(address)}
        answer = await self._write(request)
        return self._registry.get(address.url) or _endpoint(answer)

    async def drain(self, url: str) -> Endpoint:
        """The owner drains the instance (404 when unknown)."""
        answer = await self._write({"op": "remove", "url": url})
        return self._registry.get(url) or _endpoint(answer)

    async def _write(self, request: dict[str, Any]) -> dict[str, Any]:
        answer = await self._ask(request, self._admin_timeout)
        if not answer.get("ok"):
            raise AdminError(int(answer.get("status", 500)), str(answer.get("error")))
        await self._synced(int(answer["seq"]))
        return answer

    async def _ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        if self._control is None:
            raise AdminError(503, "this worker is not connected to the membership owner")
        request_id = str(next(self._ids)).encode()
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._answers[request_id] = future
        try:
            async with asyncio.timeout(timeout):  # the send too: it waits for a connection
                await self._control.send_multipart([request_id, pack(request)])
                return await future
        except TimeoutError as exc:
            raise AdminError(503, "the membership owner did not answer") from exc
        finally:
            self._answers.pop(request_id, None)

    async def _synced(self, seq: int) -> None:
        """Until this worker has applied snapshot ``seq`` (bounded: the owner published it
        before answering, so it is already on the socket)."""
        try:
            async with asyncio.timeout(_START_TIMEOUT):
                while self.seq < seq:
                    self._applied.clear()
                    await self._applied.wait()
        except TimeoutError as exc:
            raise AdminError(503, "applied, but not yet seen by this worker") from exc

    async def _read_answers(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            future = self._answers.get(frames[0]) if len(frames) == 2 else None
            if future is None or future.done():
                continue
            try:
                future.set_result(unpack(frames[1]))
            except ValueError as exc:
                future.set_exception(AdminError(502, f"bad answer from the owner: {exc}"))

    # -- following the owner -------------------------------------------------------------

    async def _follow(self, sub: zmq.asyncio.Socket) -> None:
        while True:
            raw = await sub.recv()
            try:
                self.apply(decode_snapshot(raw))
            except Exception:  # one bad snapshot must not end the following
                logger.exception("worker: could not apply a membership snapshot")

    def apply(self, snapshot: Snapshot) -> None:
        """Make the local registry the owner's, keeping this worker's own figures."""
        if snapshot.seq <= self.seq:
            return
        listed = set()
        for record in snapshot.endpoints:
            listed.add(record.address.url)
            self._apply_one(record)
        for endpoint in self._registry.all():
            if endpoint.url in listed:
                continue
            if endpoint.legs.in_flight:  # this worker's legs finish first
                if endpoint.state is not EndpointState.DRAINING:
                    self._registry.set_state(endpoint.url, EndpointState.DRAINING)
            else:
                self._registry.remove(endpoint.url)
        self.seq = snapshot.seq
        self.backend = snapshot.backend
        self._applied.set()

    def _apply_one(self, record: EndpointRecord) -> None:
        endpoint = self._registry.get(record.address.url)
        if (
            endpoint is None
            or endpoint.role is not record.role
            or endpoint.address != record.address
        ):
            self._registry.add(record.endpoint())
            endpoint = self._registry.get(record.address.url)
            assert endpoint is not None
        else:
            if (endpoint.source, endpoint.models, endpoint.engine_ids) != (
                record.source,
                record.models,
                record.engine_ids,
            ):
                reidentify(
                    endpoint,
                    source=record.source,
                    models=record.models,
                    engine_ids=record.engine_ids,
                )
                self._registry.invalidate()  # its models decide which pools it is in
            self._registry.seen(endpoint.url, record.last_seen)
            if endpoint.state is not record.state:
                self._registry.set_state(endpoint.url, record.state)
            self._apply_probe(endpoint, record)
        self._apply_load(endpoint, record)

    def _apply_probe(self, endpoint: Endpoint, record: EndpointRecord) -> None:
        if self._outliers.on_published_probe(endpoint, record.probe, record.probe_failures):
            self._registry.invalidate()

    def _apply_load(self, endpoint: Endpoint, record: EndpointRecord) -> None:
        load = record.load
        if load is None or (
            endpoint.load.engine_load is not None
            and endpoint.load.engine_load.scraped_at == load.scraped_at
        ):
            return
        # The engine's figures count every worker's legs; this worker's own are added live
        # by the scheduler, so they come off here (the load scraper's own rule).
        apply_load(endpoint, load, self._max_age)

    async def _watch_parent(self) -> None:
        while True:
            await asyncio.sleep(_PARENT_POLL)
            if os.getppid() != self.spec.parent_pid:
                logger.warning("worker: the supervisor is gone; draining")
                os.kill(os.getpid(), signal.SIGTERM)
                return


def _endpoint(answer: dict[str, Any]) -> Endpoint:
    """The owner's view of the instance, when this worker no longer has it (drained)."""
    return record_from(answer["endpoint"]).endpoint()
