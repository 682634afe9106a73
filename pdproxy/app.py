"""The composition root: ``create_app`` builds one pdproxy's services (``pdproxy.build``, no
FastAPI there), wires what runs beside the requests (``Services``) and the ASGI app
(``pdproxy.api.app``)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

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
from pdproxy.observability.tracing import Tracer


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
        config,
        clock,
        metrics_registry or CollectorRegistry(),
        rng or random.Random(),
        tracer=tracer,
        worker=worker,
    )
    dashboard = Dashboard(state, clock) if config.dashboard else None
    services = Services(state, dashboard)

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

    return asgi_app(state, lifespan, dashboard)


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


class Services:
    """The parts that run beside the requests, each started once before the first one
    arrives and closed once, in reverse, after the last."""

    def __init__(self, state: AppState, dashboard: Dashboard | None) -> None:
        self._state = state
        self._dashboard = dashboard

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
            await state.control.start()
        if self._dashboard is not None:
            self._dashboard.start()

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
        await state.control.aclose()
        await state.release.aclose()
        await state.orchestrator.aclose()
        await state.passthrough.aclose()
        if state.render_once is not None:
            await state.render_once.aclose()
        if state.kv_events is not None:
            await state.kv_events.aclose()
        await state.client.aclose()
        await asyncio.to_thread(state.tracer.shutdown)  # flushes the last spans
