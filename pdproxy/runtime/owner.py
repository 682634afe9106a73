"""The membership owner: the one process that knows which instances exist.

It runs what a single pdproxy runs beside its requests, and nothing else: the control plane
(``pdproxy.membership.control_plane``: the static instances, the ZMQ registry socket, the
active health checks, the engines' ``/metrics`` scrapes and the sweeper; whatever else feeds
``Membership`` there feeds the workers too, with no code here), plus the admin API's writes
the workers forward and ``MembershipHub``, which publishes the registry to the workers. It
builds the same services as a single pdproxy, from the same function (``build_state``, no
FastAPI app), and serves no HTTP. It has no request in flight, so its instances' in-flight
counts stay 0: a drained instance leaves the owner's registry at once, and each worker keeps
it as DRAINING until its own legs on it end (``pdproxy.membership.workers.link``).
"""

from __future__ import annotations

import asyncio
import random
import time

from prometheus_client import CollectorRegistry

from pdproxy.api.state import AppState
from pdproxy.build import build_state
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.workers import RunDir
from pdproxy.membership.workers.hub import MembershipHub


class MembershipOwner:
    def __init__(self, config: ProxyConfig, run_dir: RunDir) -> None:
        # ConfigError: what only the connector knows
        self.state: AppState = build_state(
            config, time.monotonic, CollectorRegistry(), random.Random()
        )
        self.hub = MembershipHub(
            registry=self.state.registry,
            membership=self.state.membership,
            run_dir=run_dir,
            backend=self.state.registry_backend,
        )

    async def start(self) -> None:
        """As a single pdproxy starts: the static instances' first probes and warm-ups are
        awaited, so the workers start with a known fleet."""
        await self.state.client.start()
        await self.state.control.start()
        self.hub.start()
        self.state.membership.refresh_gauges()

    async def aclose(self) -> None:
        await self.hub.aclose()
        await self.state.control.aclose()
        await self.state.client.aclose()
        await asyncio.to_thread(self.state.tracer.shutdown)
