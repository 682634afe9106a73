"""``create_app``: builds every stateful object and wires the lifespan."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from pdproxy.api.admin import router as admin_router
from pdproxy.api.auth import ClientKeys
from pdproxy.api.dashboard import Dashboard
from pdproxy.api.errors import error_response
from pdproxy.api.info import router as info_router
from pdproxy.api.openai import GenerationEndpoint
from pdproxy.api.passthrough import PassthroughEndpoint
from pdproxy.api.state import AppState
from pdproxy.config.proxy import ProxyConfig, RetryConfig
from pdproxy.config.workers import WorkerSpec
from pdproxy.connectors import KVConnector, load_connector
from pdproxy.errors import ConfigError, ProxyError
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.membership.discovery.shared import require_etcd
from pdproxy.membership.discovery.zmq import ZmqRegistry
from pdproxy.membership.health import HealthChecker
from pdproxy.membership.load_scraper import LoadScraper
from pdproxy.membership.membership import Membership
from pdproxy.membership.workers.link import OwnerLink
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.observability.multiproc import WorkerGauges, exposition_registry
from pdproxy.observability.tracing import Tracer, load_tracer
from pdproxy.proxying.admission import Admission
from pdproxy.proxying.kv_release import KVRelease
from pdproxy.proxying.legs import Legs
from pdproxy.proxying.lifecycle import Lifecycle
from pdproxy.proxying.orchestrator import Orchestrator
from pdproxy.proxying.passthrough import Passthrough
from pdproxy.proxying.render_once import RenderOnce
from pdproxy.proxying.verdicts import Verdicts
from pdproxy.resilience.outlier import OutlierDetector
from pdproxy.resilience.retry import RetryBudget
from pdproxy.scheduling.scheduler import Scheduler
from pdproxy.types import ApiKind, Endpoint, Role, Source
from pdproxy.upstream.engine_client import EngineClient
from pdproxy.wire.routes import ROUTES

# --workers: the longest an admin write waits for the owner, past the warm-up's timeout (the
# owner probes the instance first, within the probe pool's timeouts).
_ADMIN_TIMEOUT = 60.0

if TYPE_CHECKING:  # imported at run time only under --registry-backend etcd://
    from pdproxy.membership.discovery.etcd import EtcdRegistry


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
    state = _build_state(
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
        try:
            yield
        finally:
            await services.aclose()

    generation = {kind.path: GenerationEndpoint(kind, state) for kind in ApiKind}
    passthrough = {r.path: PassthroughEndpoint(r, state) for r in ROUTES}
    hot_paths: dict[str, ASGIApp] = {
        **generation,
        **{path: e for path, e in passthrough.items() if e.route.method == "POST"},
    }
    app = _ProxyApp(hot_paths, title="pdproxy", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.pdproxy = state
    app.state.zmq_registry = registry
    app.state.services = services  # the --workers owner runs their membership part alone
    _mount(app, generation, passthrough, dashboard)
    return app


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
    state.exposition = exposition_registry(
        worker.run_dir.metrics, state.registry, state.metrics.registry
    )
    state.worker_gauges = WorkerGauges(
        state.metrics, state.registry, state.membership.refresh_gauges, state.registry_backend
    )


def _mount(
    app: FastAPI,
    generation: dict[str, GenerationEndpoint],
    passthrough: dict[str, PassthroughEndpoint],
    dashboard: Dashboard | None,
) -> None:
    # The hot paths are also routed normally, so the OpenAPI schema and 405s stay right.
    for path, endpoint in generation.items():
        app.router.routes.append(Route(path, endpoint, methods=["POST"]))
    for path, passthrough_endpoint in passthrough.items():
        app.router.routes.append(
            Route(path, passthrough_endpoint, methods=[passthrough_endpoint.route.method])
        )
    app.include_router(info_router)
    app.include_router(admin_router)
    if dashboard is not None:
        dashboard.mount(app)
    app.add_exception_handler(ProxyError, _proxy_error)


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
        await state.health.settle()
        await state.membership.settle()  # the static instances' warm-ups (--warm-pairs)
        state.health.start()
        state.loads.start()
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
        await state.membership.aclose()


@dataclass(frozen=True, slots=True)
class _Core:
    """What every part of the state shares."""

    registry: EndpointRegistry
    client: EngineClient
    metrics: ProxyMetrics
    connector: KVConnector
    outliers: OutlierDetector


def _build_state(
    config: ProxyConfig,
    clock: Callable[[], float],
    metrics_registry: CollectorRegistry,
    rng: random.Random,
) -> AppState:
    core = _Core(
        registry=EndpointRegistry(clock),
        client=EngineClient(
            config.timeouts, config.pool, _bearer(config.engine_api_key), tls=config.engine_tls
        ),
        metrics=ProxyMetrics(metrics_registry),
        connector=load_connector(config),
        outliers=OutlierDetector(config.outlier, clock),
    )
    health = HealthChecker(
        config.health, registry=core.registry, client=core.client, outliers=core.outliers
    )
    release = KVRelease(
        connector=core.connector,
        client=core.client,
        registry=core.registry,
        outliers=core.outliers,
        metrics=core.metrics,
    )
    membership = Membership(
        config=config,
        registry=core.registry,
        client=core.client,
        connector=core.connector,
        metrics=core.metrics,
        health=health,
        clock=clock,
    )
    scheduler = _scheduler(config, core, clock, rng)
    budget = _retry_budget(config.retry, clock)  # fleet-wide: generation and pass-through
    orchestrator = _orchestrator(config, core, release, scheduler, budget, rng)
    passthrough = _passthrough(config, core, scheduler, budget, rng)
    state = _app_state(config, core, orchestrator, passthrough, membership, health, release, clock)
    if config.render_once:
        state.render_once = _render_once(config, core, orchestrator, scheduler, budget, rng, clock)
    return state


def _orchestrator(
    config: ProxyConfig,
    core: _Core,
    release: KVRelease,
    scheduler: Scheduler,
    budget: RetryBudget,
    rng: random.Random,
) -> Orchestrator:
    legs = Legs(
        connector=core.connector,
        client=core.client,
        timeouts=config.timeouts,
        verdicts=Verdicts(core.outliers, core.registry, core.metrics),
        metrics=core.metrics,
    )
    return Orchestrator(
        registry=core.registry,
        scheduler=scheduler,
        connector=core.connector,
        legs=legs,
        outliers=core.outliers,
        release=release,
        retry=config.retry,
        budget=budget,
        metrics=core.metrics,
        rng=rng,
    )


def _passthrough(
    config: ProxyConfig,
    core: _Core,
    scheduler: Scheduler,
    budget: RetryBudget,
    rng: random.Random,
) -> Passthrough:
    return Passthrough(
        registry=core.registry,
        scheduler=scheduler,
        client=core.client,
        timeouts=config.timeouts,
        verdicts=Verdicts(core.outliers, core.registry, core.metrics),
        outliers=core.outliers,
        retry=config.retry,
        budget=budget,
        metrics=core.metrics,
        rng=rng,
    )


def _render_once(
    config: ProxyConfig,
    core: _Core,
    orchestrator: Orchestrator,
    scheduler: Scheduler,
    budget: RetryBudget,
    rng: random.Random,
    clock: Callable[[], float],
) -> RenderOnce:
    """--render-once: renders on the --render servers (picked, retried and ejected like
    decodes, among themselves), else on the decodes."""
    if not core.connector.serves_decode_alone:
        raise ConfigError(
            f"--render-once needs decodes that answer alone; {config.kv_connector}'s wait for KV"
        )
    servers = tuple(
        Endpoint(role=Role.DECODE, address=a, source=Source.STATIC) for a in config.render
    )
    pool = (lambda: servers) if servers else None
    peers = (lambda _: servers) if servers else None
    render = Passthrough(
        registry=core.registry,
        scheduler=scheduler,
        client=core.client,
        timeouts=config.timeouts,
        verdicts=Verdicts(core.outliers, core.registry, core.metrics, peers),
        outliers=core.outliers,
        retry=config.retry,
        budget=budget,
        metrics=core.metrics,
        rng=rng,
        pool=pool,
    )
    return RenderOnce(
        orchestrator=orchestrator,
        render=render,
        registry=core.registry,
        client=core.client,
        metrics=core.metrics,
        clock=clock,
    )


def _scheduler(
    config: ProxyConfig, core: _Core, clock: Callable[[], float], rng: random.Random
) -> Scheduler:
    # An engine's load figures count for three scrape intervals, then they are ignored.
    max_age = 3 * config.health.engine_metrics_interval
    decode_only = config.scheduling.pd_threshold_tokens or config.scheduling.decode_only_fallback
    if decode_only and not core.connector.serves_decode_alone:
        raise ConfigError(
            f"--pd-threshold-tokens and --decode-only-fallback need decodes that can serve a"
            f" request alone, which {config.kv_connector}'s cannot (they wait for their"
            " prefill's KV)"
        )
    scheduler = Scheduler(
        config.scheduling,
        clock=clock,
        rng=rng,
        max_age=max_age,
        decode_alone=core.connector.serves_decode_alone,
    )
    core.registry.on_removal(scheduler.forget)
    return scheduler


def _app_state(
    config: ProxyConfig,
    core: _Core,
    orchestrator: Orchestrator,
    passthrough: Passthrough,
    membership: Membership,
    health: HealthChecker,
    release: KVRelease,
    clock: Callable[[], float],
) -> AppState:
    state = AppState(
        config,
        core.registry,
        core.client,
        core.metrics,
        orchestrator,
        membership,
        health,
        core.outliers,
        release,
        keys=ClientKeys(config.api_keys),
        lifecycle=Lifecycle(core.registry, lambda: state.in_flight),
        loads=LoadScraper(
            config.health,
            registry=core.registry,
            client=core.client,
            metrics=core.metrics,
            clock=clock,
        ),
        passthrough=passthrough,
        clock=clock,
        admission=(Admission(config.admission, core.metrics) if config.admission.enabled else None),
        engine_authorization=_bearer(config.engine_api_key),
    )
    core.metrics.track_in_flight(lambda: state.in_flight)
    core.metrics.track_endpoint_in_flight(
        lambda: ((e.role.value, e.url, e.in_flight) for e in core.registry.all())
    )
    return state


def _bearer(key: str | None) -> str | None:
    return None if key is None else f"Bearer {key}"


def _retry_budget(config: RetryConfig, clock: Callable[[], float]) -> RetryBudget:
    return RetryBudget(
        ratio=config.budget_ratio,
        window=config.budget_window,
        min_per_sec=config.budget_min_per_sec,
        clock=clock,
    )


async def _proxy_error(request: Request, exc: Exception) -> Response:
    if not isinstance(exc, ProxyError):
        raise exc
    return error_response(exc)


class _ProxyApp(FastAPI):
    """FastAPI for everything but the generation (and POST pass-through) endpoints, which go
    straight to their handlers: FastAPI's own ``__call__`` and middleware stack cost a dozen
    ASGI layers and an environment lookup per request, a measurable share of the proxy's
    CPU."""

    def __init__(self, hot_paths: dict[str, ASGIApp], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._hot_paths = hot_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self._hot_paths.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await super().__call__(scope, receive, send)
