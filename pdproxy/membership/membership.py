"""Admission of engine instances into the registry, from every source.

Registered instances (ZMQ heartbeats) expire ``ttl`` seconds after their last message;
static (command line) and admin-added ones never expire. Before an instance is routable it
must agree with the deployment: one transfer mode for all, the ``--model`` if one is set,
and whatever the connector must learn from it (Mooncake's engine ids); under
``--warm-pairs`` it then warms a few P/D pairs with its peers (``pdproxy.membership.warmup``).
Probes run on the event loop in the background; a sweep timer expires, re-probes and finishes
drains.

Every source first passes ``InstanceGuard`` (``guard``): an instance that is this
pdproxy's own listener (a routing loop) or another spelling of a known instance is refused.

Observers (``observe``) hear what this process learns by itself: heartbeats, admin
additions and removals, expiries. The shared registry (``pdproxy.membership.discovery.etcd``) is
one: it publishes them, and admits what other replicas publish through ``learn``, ``forget``
and ``drain(announce=False)``, which observers do not hear, so nothing echoes back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from pdproxy.config.proxy import ProxyConfig
from pdproxy.connectors import KVConnector
from pdproxy.errors import AdminError
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.membership.guard import InstanceGuard, OwnListener, Refusal
from pdproxy.membership.health import HealthChecker
from pdproxy.membership.instance_checks import InstanceChecks
from pdproxy.membership.warmup import PairWarmer
from pdproxy.observability.log import RateLimitedLogger
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.types import (
    Endpoint,
    EndpointState,
    EngineAddress,
    ProbeState,
    Registration,
    Role,
    Source,
)
from pdproxy.upstream.engine_client import EngineClient
from pdproxy.wire.hop import Hop

logger = logging.getLogger(__name__)


class MembershipObserver(Protocol):
    """What this process learned by itself (never what it was told through ``learn``)."""

    def heard(self, endpoint: Endpoint) -> None:
        """A heartbeat was accepted for this registered instance (every one of them)."""

    def added(self, endpoint: Endpoint) -> None:
        """The admin API added it."""

    def drained(self, url: str) -> None:
        """The admin API removed it (it drains)."""

    def expired(self, url: str) -> None:
        """Its heartbeats stopped for a TTL: it left the registry."""


class Membership:
    def __init__(
        self,
        *,
        config: ProxyConfig,
        registry: EndpointRegistry,
        client: EngineClient,
        connector: KVConnector,
        metrics: ProxyMetrics,
        health: HealthChecker,
        clock: Callable[[], float],
        wall_clock: Callable[[], float] = time.time,
        own: OwnListener | None = None,
    ) -> None:
        self._config = config
        self._health = health
        self._registry = registry
        self._checks = InstanceChecks(config, client, connector)
        self._metrics = metrics
        self._clock = clock
        self._wall_clock = wall_clock
        self._log = RateLimitedLogger(logger, clock)
        self.transfer_mode = config.transfer_mode
        self._probes: dict[str, asyncio.Task[None]] = {}
        self._retired: dict[str, float] = {}  # url -> until when its heartbeats are ignored
        self._sweeper: asyncio.Task[None] | None = None
        self._observers: list[MembershipObserver] = []
        own = own or OwnListener.discover(config.host, config.port)
        self._guard = InstanceGuard(own, registry.get)
        registry.on_removal(self._guard.forgot)
        self._warmer = PairWarmer(
            config.health,
            registry=registry,
            client=client,
            connector=connector,
            model=config.model,
            via=Hop.of(config.hop_id).via,
        )

    # -- sources -------------------------------------------------------------------------

    def add_static(self) -> None:
        for role, addresses in (
            (Role.PREFILL, self._config.prefill),
            (Role.DECODE, self._config.decode),
        ):
            for address in addresses:
                refusal = self._guard.check(address.url)
                if refusal is not None:
                    logger.error("refused %s %s: %s", role.value, address.url, refusal.reason)
                    continue
                self._admit(Endpoint.new(role=role, address=address, source=Source.STATIC))

    def listening(self, port: int) -> None:
        """The port pdproxy's listener got, when it was not known up front (``--port 0``)."""
        self._guard.own.listening(port)

    def heartbeat(self, registration: Registration) -> str:
        """Apply one registration message; returns the outcome label."""
        url = registration.address.url
        if self._is_retired(url):
            return "retired"
        if not self._mode_matches(registration.address):
            self._log.warning(
                "mode:" + url,
                "refused %s: transfer mode %s, deployment uses %s",
                url,
                registration.address.transfer_mode,
                self.transfer_mode,
            )
            return "refused"
        existing = self._registry.get(url)
        if existing is not None and existing.source is not Source.REGISTERED:
            self._registry.seen(url, self._wall_clock())
            return "accepted"
        if existing is None and self._refused(url, self._guard.check(url)):
            return "refused"
        if (
            existing is None
            or existing.address != registration.address
            or existing.role is not registration.role
        ):
            self._admit(
                Endpoint.new(
                    role=registration.role, address=registration.address, source=Source.REGISTERED
                )
            )
            logger.info("registered %s %s (%s)", registration.role.value, url, registration.format)
        self._registry.touch(url, self._config.registry.ttl, self._wall_clock())
        if self._observers:
            endpoint = self._registry.get(url)
            if endpoint is not None:
                for observer in self._observers:
                    observer.heard(endpoint)
        return "accepted"

    async def add_admin(self, role: Role, address: EngineAddress) -> Endpoint:
        """Admit an instance for the admin API; raises ``AdminError`` (409, 400)."""
        if self._registry.get(address.url) is not None:
            raise AdminError(409, f"instance {address.host_port} is already registered")
        refusal, resolved = await self._guard.check_resolved(
            address.url, self._config.timeouts.connect
        )
        if refusal is not None:
            raise AdminError(refusal.status, f"instance {address.host_port}: {refusal.reason}")
        if not self._mode_matches(address):
            raise AdminError(
                400,
                f"transfer mode {address.transfer_mode} does not match the deployment's "
                f"{self.transfer_mode}",
            )
        endpoint = Endpoint.new(
            role=role, address=address, source=Source.ADMIN, state=EndpointState.PENDING
        )
        problem = await self._checks.run(endpoint, require_reachable=True)
        if problem is not None:
            raise AdminError(400, problem)
        if self._registry.get(address.url) is not None:  # raced with a heartbeat
            raise AdminError(409, f"instance {address.host_port} is already registered")
        self._warmer.forget(address.url)
        await self._warmer.warm(endpoint)
        if self._registry.get(address.url) is not None:
            raise AdminError(409, f"instance {address.host_port} is already registered")
        self._retired.pop(address.url, None)
        self._registry.add(endpoint, EndpointState.READY)
        self._guard.admitted(address.url, *resolved)
        logger.info("admin added %s %s", role.value, address.url)
        for observer in self._observers:
            observer.added(endpoint)
        return endpoint

    def drain(self, url: str, *, announce: bool = True) -> Endpoint:
        """No new requests for ``url``; it leaves the registry once its in-flight legs end.
        ``announce=False``: another replica's removal, applied here (observers don't hear)."""
        endpoint = self._registry.get(url)
        if endpoint is None:
            alias = self._guard.known_as(url)  # removed by another spelling of its address
            endpoint = None if alias is None else self._registry.get(alias)
        if endpoint is None:
            raise AdminError(404, "no such instance")
        url = endpoint.url
        self._registry.set_state(url, EndpointState.DRAINING)
        if endpoint.source is Source.REGISTERED:
            self._retired[url] = self._clock() + self._config.registry.ttl
        logger.info("draining %s (%d in flight)", url, endpoint.legs.in_flight)
        if announce:
            for observer in self._observers:
                observer.drained(url)
        self._finish_drains()
        return endpoint

    # -- the shared registry -------------------------------------------------------------

    def observe(self, observer: MembershipObserver) -> None:
        self._observers.append(observer)

    def learn(self, role: Role, address: EngineAddress, source: Source) -> Endpoint | None:
        """Admit (or replace) an instance another replica announced, through the same
        checks as any other source; it never expires here (its claim's lease is its TTL,
        ``forget`` drops it). None when refused: another transfer mode, or a registered
        instance this replica retired."""
        url = address.url
        if source is Source.REGISTERED and self._retired.get(url, 0.0) > self._clock():
            return None
        if not self._mode_matches(address):
            self._log.warning(
                "mode:" + url,
                "refused shared %s: transfer mode %s, deployment uses %s",
                url,
                address.transfer_mode,
                self.transfer_mode,
            )
            return None
        if self._registry.get(url) is None and self._refused(url, self._guard.check(url)):
            return None
        self._retired.pop(url, None)
        endpoint = Endpoint.new(role=role, address=address, source=source)
        self._admit(endpoint)
        logger.info("learned %s %s (%s) from the shared registry", role.value, url, source.value)
        return endpoint

    def forget(self, url: str) -> None:
        """Drop an instance learned from the shared registry: no replica claims it any more."""
        if self._registry.remove(url) is not None:
            logger.info("forgot %s: no replica announces it any more", url)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_forever())

    async def settle(self) -> None:
        """Under ``--warm-pairs``, await the admissions in progress (the static instances'
        warm-ups), each bounded by the warm-up timeout, so the proxy starts warm."""
        if self._warmer.enabled and self._probes:
            await asyncio.wait(list(self._probes.values()))

    async def aclose(self) -> None:
        tasks = [t for t in (self._sweeper, *self._probes.values()) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._warmer.aclose()

    def sweep(self) -> None:
        """Expire silent instances, finish drains, retry pending probes."""
        for endpoint in self._registry.expire():
            logger.info(
                "expired %s %s: no heartbeat for %.1f s",
                endpoint.role.value,
                endpoint.url,
                self._config.registry.ttl,
            )
            for observer in self._observers:
                observer.expired(endpoint.url)
        self._finish_drains()
        now = self._clock()
        self._retired = {u: t for u, t in self._retired.items() if t > now}
        for endpoint in self._registry.all():
            if endpoint.state is EndpointState.PENDING:
                self._probe_in_background(endpoint)
        self.refresh_gauges()

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self._config.registry.sweep_interval)
            try:
                self.sweep()
            except Exception:  # the sweeper must outlive any one bad entry
                logger.exception("registry sweep failed")

    # -- admission -----------------------------------------------------------------------

    def _refused(self, url: str, refusal: Refusal | None) -> bool:
        """Log a refusal (rate-limited: a peer chooses how often); True if refused."""
        if refusal is None:
            return False
        self._log.warning("guard", "refused %s: %s", url, refusal.reason)
        return True

    def _admit(self, endpoint: Endpoint) -> None:
        self._guard.admitted(endpoint.url)
        self._health.admitted(endpoint)
        self._warmer.forget(endpoint.url)
        if self._needs_probe(endpoint):
            self._registry.add(endpoint, EndpointState.PENDING)
            self._probe_in_background(endpoint)
        else:
            self._registry.add(endpoint)
        if self.transfer_mode is None and endpoint.address.transfer_mode is not None:
            self.transfer_mode = endpoint.address.transfer_mode
            logger.info("transfer mode fixed to %s by %s", self.transfer_mode, endpoint.url)

    def _needs_probe(self, endpoint: Endpoint) -> bool:
        # Registered (and shared) instances: their models before they are routable.
        model_check = endpoint.source is not Source.STATIC
        return (
            model_check or self._checks.bootstrap_url(endpoint) is not None or self._warmer.enabled
        )

    def _probe_in_background(self, endpoint: Endpoint) -> None:
        if endpoint.url in self._probes:
            return
        task = asyncio.create_task(self._probe(endpoint))
        self._probes[endpoint.url] = task
        task.add_done_callback(lambda _: self._probes.pop(endpoint.url, None))

    async def _probe(self, endpoint: Endpoint) -> None:
        try:
            problem = await self._checks.run(endpoint, require_reachable=False)
        except Exception:  # an answer no check foresaw must not end the probe unseen
            logger.exception("probe of %s failed", endpoint.url)
            problem = "its probe failed"
        if problem is None:
            await self._warmer.warm(endpoint)  # bounded; routable afterwards whatever happened
        if self._registry.get(endpoint.url) is not endpoint:
            return  # replaced or removed while probing
        if problem is None:
            self._registry.set_state(endpoint.url, EndpointState.READY)
            logger.info("%s %s is routable", endpoint.role.value, endpoint.url)
        elif problem:
            self._registry.remove(endpoint.url)
            self._log.warning("probe:" + endpoint.url, "refused %s: %s", endpoint.url, problem)

    def _mode_matches(self, address: EngineAddress) -> bool:
        mode = address.transfer_mode
        return mode is None or self.transfer_mode is None or mode == self.transfer_mode

    def _is_retired(self, url: str) -> bool:
        until = self._retired.get(url)
        if until is None:
            return False
        # Heartbeats keep a retired instance retired; silence for a TTL forgets it.
        self._retired[url] = self._clock() + self._config.registry.ttl
        return True

    def _finish_drains(self) -> None:
        for endpoint in self._registry.all():
            if endpoint.state is EndpointState.DRAINING and endpoint.legs.in_flight == 0:
                self._registry.remove(endpoint.url)
                logger.info("drained and removed %s", endpoint.url)

    def refresh_gauges(self) -> None:
        """Per-role counts and per-instance health series; also run at each scrape."""
        counts: dict[tuple[str, str], int] = {}
        for endpoint in self._registry.all():
            key = (endpoint.role.value, endpoint.state.value)
            counts[key] = counts.get(key, 0) + 1
        for role in Role:
            for state in EndpointState:
                self._metrics.endpoints.labels(role.value, state.value).set(
                    counts.get((role.value, state.value), 0)
                )
        self._metrics.set_endpoint_health(
            (
                e.role.value,
                e.url,
                e.health.probe is ProbeState.HEALTHY,
                e.health.ejected_until is not None,
            )
            for e in self._registry.all()
        )
        self._metrics.set_endpoint_models(
            (e.role.value, e.url, e.models) for e in self._registry.all()
        )
