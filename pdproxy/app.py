"""The composition root: ``create_app`` builds one pdproxy's objects (``pdproxy.build``), wires
what runs beside the requests (``Services``) and the ASGI app (``pdproxy.api.app``)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from pdproxy.api.app import asgi_app
from pdproxy.api.dashboard import Dashboard
from pdproxy.api.flow import reload_tenants
from pdproxy.api.state import AppState
from pdproxy.build import build_state
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.workers import WorkerSpec
from pdproxy.errors import ConfigError
from pdproxy.flow.shared import LimitsFile
from pdproxy.membership.discovery.shared import require_etcd
from pdproxy.membership.discovery.zmq import ZmqRegistry
from pdproxy.membership.workers.link import OwnerLink
from pdproxy.observability.multiproc import WorkerGauges, exposition_registry
from pdproxy.observability.tracing import Tracer, load_tracer

if TYPE_CHECKING:  # imported at run time only under --registry-backend etcd://
    from pdproxy.membership.discovery.etcd import EtcdRegistry


# --workers: the longest an admin write waits for the owner, past the warm-up's timeout (the
# owner probes the instance first, within the probe pool's timeouts).
_ADMIN_TIMEOUT = 60.0


def create_app(
    config: ProxyConfig,
    *,
    clock: Callable[[], float] = time.monotonic,
    metrics_registry: CollectorRegistry | None = None,
    rng: random.Random | None = None,
    tracer: Tracer | None = None,
    worker: WorkerSpec | None = None,
) -> FastAPI:
    """The app of a single pdproxy, or with ``worker`` of one ``--workers`` process, whose
    membership follows the owner's (``pdproxy.runtime``)."""
    state = build_state(
        config, clock, metrics_registry or CollectorRegistry(), rng or random.Random()
    )
    state.tracer = tracer or load_tracer(config.otlp_traces_endpoint)
    registry = (
        ZmqRegistry(config.registry, state.membership, state.metrics)
        if config.registry.port and worker is None
        else None
    )
    if worker is not None:
        _follow_owner(state, worker)
    dashboard = Dashboard(state, clock) if config.dashboard else None
    # the shared registry runs in the process that owns the membership; workers show its
    # status as the owner publishes it
    shared = _shared_registry(config, state) if worker is None else None
    if shared is not None:
        state.registry_backend = shared.status
    services = Services(state, registry, dashboard, shared)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await services.start()
        hup = _reload_on_sighup(state)
        try:
            yield
        finally:
            if hup:
                asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            await services.aclose()

    app = asgi_app(state, lifespan, dashboard)
    app.state.zmq_registry = registry
    app.state.services = services  # the --workers owner runs their membership part alone
    return app


def _reload_on_sighup(state: AppState) -> bool:
    """SIGHUP reloads the tenants file (``--tenants``); True when the handler is set (not
    where the loop cannot take signals: a thread, Windows)."""
    if state.admission is None or state.admission.tenants.path is None:
        return False

    def reload() -> None:
        with contextlib.suppress(ConfigError):  # logged; the old file stays
            reload_tenants(state)

    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)
    except (RuntimeError, ValueError, NotImplementedError):
        return False
    return True


def _follow_owner(state: AppState, worker: WorkerSpec) -> None:
    """A worker: membership from the owner, admin writes to it, /metrics from every process."""
    config = state.config
    state.owner_link = OwnerLink(
        worker,
        registry=state.registry,
        outliers=state.outliers,
        max_age=state.loads.max_age,
        admin_timeout=_ADMIN_TIMEOUT + config.health.warm_timeout,
    )
    state.registry_backend = state.owner_link.backend_status
    if state.admission is not None:  # the tenants' limits, exact across the workers
        state.admission.limits.share(LimitsFile(worker.run_dir.limits, worker.index, worker.count))
    state.exposition = exposition_registry(
        worker.run_dir.metrics, state.registry, state.metrics.registry
    )
    state.worker_gauges = WorkerGauges(
        state.metrics,
        state.registry,
        state.membership.refresh_gauges,
        state.registry_backend,
        directory=worker.run_dir.metrics,
        index=worker.index,
    )


def _shared_registry(config: ProxyConfig, state: AppState) -> EtcdRegistry | None:
    """--registry-backend etcd://: the replicas' shared registry (imported only then)."""
    if not config.registry.shared.enabled:
        return None
    require_etcd()
    from pdproxy.membership.discovery.etcd import EtcdRegistry

    return EtcdRegistry(
        config.registry.shared,
        registry_ttl=config.registry.ttl,
        membership=state.membership,
        registry=state.registry,
        metrics=state.metrics,
    )


class Services:
    """The parts that run beside the requests, started before the first one arrives and
    stopped, in reverse, after the last."""

    def __init__(
        self,
        state: AppState,
        registry: ZmqRegistry | None,
        dashboard: Dashboard | None,
        shared: EtcdRegistry | None = None,
    ) -> None:
        self._state = state
        self._registry = registry
        self._dashboard = dashboard
        self._shared = shared

    async def start(self) -> None:
        # Open the upstream pools, admit the static instances, start the sweeper and the
        # registry socket, in that order, before the first request can arrive. The static
        # instances' first health probes (and warm-ups) are awaited, so the proxy starts
        # with a known fleet rather than routing to an instance that never answered.
        state = self._state
        await state.client.start()
        state.orchestrator.start()
        state.passthrough.start()
        if state.render_once is not None:
            state.render_once.start()
        if state.kv_events is not None:  # every worker schedules, so every worker follows
            state.kv_events.start()
        if state.owner_link is not None and state.worker_gauges is not None:
            # A worker: the owner admits, probes, scrapes and sweeps; this one follows.
            await state.owner_link.start()
            state.worker_gauges.start()
        else:
            await self.start_membership()
        if self._dashboard is not None:
            self._dashboard.start()

    async def start_membership(self) -> None:
        """Everything that feeds and keeps the membership (the pools already open): what a
        single pdproxy and the ``--workers`` membership owner run."""
        state = self._state
        state.membership.add_static()
        await asyncio.gather(
            state.health.settle(), state.models.settle(state.config.health.timeout)
        )
        await state.membership.settle()  # the static instances' warm-ups (--warm-pairs)
        state.health.start()
        state.loads.start()
        state.models.start()
        state.membership.start()
        if self._shared is not None:  # the fleet other replicas know, before heartbeats
            await self._shared.start()
        if self._registry is not None:
            self._registry.start()

    async def aclose(self) -> None:
        # uvicorn has stopped accepting and drained connections. Stop discovery, health
        # checks and load scrapes, cancel background prefill legs and KV releases, then
        # close the pools.
        state = self._state
        if self._dashboard is not None:
            await self._dashboard.aclose()
        if state.worker_gauges is not None:
            await state.worker_gauges.aclose()
        if state.owner_link is not None:
            await state.owner_link.aclose()
        await self.aclose_membership()
        await state.release.aclose()
        await state.orchestrator.aclose()
        await state.passthrough.aclose()
        if state.render_once is not None:
            await state.render_once.aclose()
        if state.kv_events is not None:
            await state.kv_events.aclose()
        await state.client.aclose()
        await asyncio.to_thread(state.tracer.shutdown)  # flushes the last spans

    async def aclose_membership(self) -> None:
        state = self._state
        if self._registry is not None:
            await self._registry.aclose()
        if self._shared is not None:
            await self._shared.aclose()
        await state.health.aclose()
        await state.loads.aclose()
        await state.models.aclose()
        await state.membership.aclose()
