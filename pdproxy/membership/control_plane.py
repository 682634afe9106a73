"""The control plane: what feeds and keeps the membership, started and closed as one.

Built once, without the web layer (``pdproxy.build.build_state``); run by a single pdproxy
beside its requests (``pdproxy.app``'s ``Services``) and by the ``--workers`` membership owner
(``pdproxy.runtime.owner``), the upstream pools already open. A worker builds it but does not
run it: it follows the owner's membership instead.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdproxy.membership.discovery.zmq import ZmqRegistry
from pdproxy.membership.health import HealthChecker
from pdproxy.membership.load_scraper import LoadScraper
from pdproxy.membership.membership import Membership
from pdproxy.membership.models import ModelReader

if TYPE_CHECKING:  # imported at run time only under --registry-backend etcd://
    from pdproxy.membership.discovery.etcd import EtcdRegistry


@dataclass(frozen=True, slots=True)
class ControlPlane:
    membership: Membership
    health: HealthChecker  # the active health checks
    loads: LoadScraper  # the engines' /metrics scrapes
    models: ModelReader  # the engines' /v1/models re-reads
    settle_timeout: float  # the longest the first /v1/models reads are awaited
    zmq: ZmqRegistry | None  # --registry-port: the registry socket; None in a worker
    shared: EtcdRegistry | None  # --registry-backend etcd://; None in-process or a worker

    async def start(self) -> None:
        """Admit the static instances and await their first probes and warm-ups, so the
        proxy starts with a known fleet; then the sweeps, the shared registry and the
        registry socket, in that order."""
        self.membership.add_static()
        await asyncio.gather(self.health.settle(), self.models.settle(self.settle_timeout))
        await self.membership.settle()  # the static instances' warm-ups (--warm-pairs)
        self.health.start()
        self.loads.start()
        self.models.start()
        self.membership.start()
        if self.shared is not None:  # the fleet other replicas know, before heartbeats
            await self.shared.start()
        if self.zmq is not None:
            self.zmq.start()

    async def aclose(self) -> None:
        if self.zmq is not None:
            await self.zmq.aclose()
        if self.shared is not None:
            await self.shared.aclose()
        await self.health.aclose()
        await self.loads.aclose()
        await self.models.aclose()
        await self.membership.aclose()
