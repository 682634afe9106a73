"""The membership owner: the one process that knows which instances exist.

It runs what a single pdproxy runs beside its requests, and nothing else: the registry
(``EndpointRegistry`` fed by ``Membership``: the static instances, the ZMQ registry socket,
the admin API's writes the workers forward), the active health checks, the engines'
``/metrics`` scrapes and the sweeper, on its own probe pool. ``MembershipHub`` publishes
the registry to the workers. It serves no client request, so its instances' in-flight
counts stay 0: a drained instance leaves the owner's registry at once, and each worker keeps
it as DRAINING until its own legs on it end (``pdproxy.workers.link``).
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from pdproxy.api.app import check_connector
from pdproxy.config import ProxyConfig
from pdproxy.connectors import load_connector
from pdproxy.discovery.zmq import ZmqRegistry
from pdproxy.engine_client import EngineClient
from pdproxy.health import HealthChecker
from pdproxy.load_scraper import LoadScraper
from pdproxy.membership import Membership
from pdproxy.metrics import ProxyMetrics
from pdproxy.registry import EndpointRegistry
from pdproxy.resilience.outlier import OutlierDetector
from pdproxy.workers.hub import MembershipHub
from pdproxy.workers.spec import RunDir


class MembershipOwner:
    def __init__(self, config: ProxyConfig, run_dir: RunDir) -> None:
        clock = time.monotonic
        self.registry = EndpointRegistry(clock)
        engine_key = config.engine_api_key
        self._client = EngineClient(
            config.timeouts,
            config.pool,
            None if engine_key is None else f"Bearer {engine_key}",
            tls=config.engine_tls,
        )
        self.metrics = ProxyMetrics(CollectorRegistry())
        outliers = OutlierDetector(config.outlier, clock)  # no legs here: never ejects
        self._health = HealthChecker(
            config.health, registry=self.registry, client=self._client, outliers=outliers
        )
        connector = load_connector(config)  # ConfigError: what only the connector knows
        check_connector(config, connector)  # before any worker starts and finds out
        self.membership = Membership(
            config=config,
            registry=self.registry,
            client=self._client,
            connector=connector,
            metrics=self.metrics,
            health=self._health,
            clock=clock,
        )
        self._loads = LoadScraper(
            config.health,
            registry=self.registry,
            client=self._client,
            metrics=self.metrics,
            clock=clock,
        )
        self._zmq = (
            ZmqRegistry(config.registry, self.membership, self.metrics)
            if config.registry.port
            else None
        )
        self.hub = MembershipHub(
            registry=self.registry, membership=self.membership, run_dir=run_dir
        )

    async def start(self) -> None:
        """As a single pdproxy starts: the static instances' first probes and warm-ups are
        awaited, so the workers start with a known fleet."""
        await self._client.start()
        self.membership.add_static()
        await self._health.settle()
        await self.membership.settle()
        self._health.start()
        self._loads.start()
        self.membership.start()
        self.hub.start()
        if self._zmq is not None:
            self._zmq.start()
        self.membership.refresh_gauges()

    async def aclose(self) -> None:
        if self._zmq is not None:
            await self._zmq.aclose()
        await self.hub.aclose()
        await self._health.aclose()
        await self._loads.aclose()
        await self.membership.aclose()
        await self._client.aclose()
