"""``build_state``: the whole of one pdproxy's services, each part computed before the
immutable ``AppState`` that holds them is made; no FastAPI here, so the ``--workers``
membership owner builds and runs its control plane from the same function."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from pdproxy.api.auth import ClientKeys
from pdproxy.api.state import AppState, InFlight
from pdproxy.build.core import Core, bearer, build_core
from pdproxy.build.request_path import build_request_path
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.workers import WorkerSpec
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.flow.shared import LimitsFile
from pdproxy.membership.control_plane import ControlPlane
from pdproxy.membership.discovery.shared import require_etcd
from pdproxy.membership.discovery.zmq import ZmqRegistry
from pdproxy.membership.health import HealthChecker
from pdproxy.membership.load_scraper import LoadScraper
from pdproxy.membership.membership import Membership
from pdproxy.membership.models import ModelReader
from pdproxy.membership.workers.link import OwnerLink
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.observability.multiproc import WorkerGauges, exposition_registry
from pdproxy.observability.tracing import Tracer, load_tracer
from pdproxy.proxying.kv_release import KVRelease
from pdproxy.proxying.lifecycle import Lifecycle

if TYPE_CHECKING:  # imported at run time only under --registry-backend etcd://
    from pdproxy.membership.discovery.etcd import EtcdRegistry

# --workers: the longest an admin write waits for the owner, past the warm-up's timeout (the
# owner probes the instance first, within the probe pool's timeouts).
_ADMIN_TIMEOUT = 60.0


@dataclass(frozen=True, slots=True)
class _WorkerParts:
    """--workers N: one worker's link to the membership owner and its share of /metrics."""

    link: OwnerLink
    exposition: CollectorRegistry
    gauges: WorkerGauges


def build_state(
    config: ProxyConfig,
    clock: Callable[[], float],
    metrics_registry: CollectorRegistry,
    rng: random.Random,
    *,
    tracer: Tracer | None = None,
    worker: WorkerSpec | None = None,
) -> AppState:
    """A single pdproxy's services, or with ``worker`` one ``--workers`` process's, whose
    membership follows the owner's (``pdproxy.runtime``)."""
    core = build_core(config, clock, metrics_registry)
    health = HealthChecker(
        config.health, registry=core.registry, client=core.client, outliers=core.outliers
    )
    release = _release(core)
    membership = Membership(
        config=config,
        registry=core.registry,
        client=core.client,
        connector=core.connector,
        metrics=core.metrics,
        health=health,
        clock=clock,
    )
    path = build_request_path(config, core, release, clock, rng)
    in_flight = InFlight()
    _track_in_flight(core.metrics, core.registry, in_flight)
    tracer = tracer or load_tracer(config.otlp_traces_endpoint)
    control = _control_plane(config, core, membership, health, clock, worker)
    parts = None if worker is None else _follow_owner(config, core, control, worker)
    return AppState(
        config=config,
        registry=core.registry,
        client=core.client,
        metrics=core.metrics,
        orchestrator=path.orchestrator,
        control=control,
        outliers=core.outliers,
        release=release,
        keys=ClientKeys(config.api_keys, config.key_tenants),
        lifecycle=Lifecycle(core.registry, lambda: in_flight.count),
        lora=core.lora,
        passthrough=path.passthrough,
        clock=clock,
        in_flight=in_flight,
        tracer=tracer,
        admission=core.admission,
        engine_authorization=bearer(config.engine_api_key),
        render_once=path.render_once,
        kv_events=path.kv_events,
        owner_link=None if parts is None else parts.link,
        exposition=None if parts is None else parts.exposition,
        worker_gauges=None if parts is None else parts.gauges,
        registry_backend=_backend_status(control, parts),
    )


def _release(core: Core) -> KVRelease:
    return KVRelease(
        connector=core.connector,
        client=core.client,
        registry=core.registry,
        outliers=core.outliers,
        metrics=core.metrics,
    )


def _control_plane(
    config: ProxyConfig,
    core: Core,
    membership: Membership,
    health: HealthChecker,
    clock: Callable[[], float],
    worker: WorkerSpec | None,
) -> ControlPlane:
    """The membership's feeds; the registry socket and the shared registry only in the
    process that owns the membership (workers show its status as the owner publishes it)."""
    zmq = None
    if config.registry.port and worker is None:
        zmq = ZmqRegistry(config.registry, membership, core.metrics)
    return ControlPlane(
        membership=membership,
        health=health,
        loads=LoadScraper(
            config.health,
            registry=core.registry,
            client=core.client,
            metrics=core.metrics,
            clock=clock,
        ),
        models=ModelReader(
            interval=config.health.models_interval,
            registry=core.registry,
            client=core.client,
            max_models=config.health.max_models,
        ),
        settle_timeout=config.health.timeout,
        zmq=zmq,
        shared=None if worker is not None else _shared_registry(config, core, membership),
    )


def _shared_registry(
    config: ProxyConfig, core: Core, membership: Membership
) -> EtcdRegistry | None:
    """--registry-backend etcd://: the replicas' shared registry (imported only then)."""
    if not config.registry.shared.enabled:
        return None
    require_etcd()
    from pdproxy.membership.discovery.etcd import EtcdRegistry

    return EtcdRegistry(
        config.registry.shared,
        registry_ttl=config.registry.ttl,
        membership=membership,
        registry=core.registry,
        metrics=core.metrics,
    )


def _follow_owner(
    config: ProxyConfig, core: Core, control: ControlPlane, worker: WorkerSpec
) -> _WorkerParts:
    """A worker: membership from the owner, admin writes to it, /metrics from every process."""
    link = OwnerLink(
        worker,
        registry=core.registry,
        outliers=core.outliers,
        max_age=control.loads.max_age,
        admin_timeout=_ADMIN_TIMEOUT + config.health.warm_timeout,
    )
    if core.admission is not None:  # the tenants' limits, exact across the workers
        core.admission.limits.share(LimitsFile(worker.run_dir.limits, worker.index, worker.count))
    exposition = exposition_registry(worker.run_dir.metrics, core.registry, core.metrics.registry)
    gauges = WorkerGauges(
        core.metrics,
        core.registry,
        control.membership.refresh_gauges,
        link.backend_status,
        directory=worker.run_dir.metrics,
        index=worker.index,
    )
    return _WorkerParts(link, exposition, gauges)


def _backend_status(
    control: ControlPlane, parts: _WorkerParts | None
) -> Callable[[], dict[str, Any]] | None:
    """The shared registry's state for /status: the owner's as it publishes it, under
    --workers; this process's own under --registry-backend etcd://; else none."""
    if parts is not None:
        return parts.link.backend_status
    return None if control.shared is None else control.shared.status


def _track_in_flight(
    metrics: ProxyMetrics, registry: EndpointRegistry, in_flight: InFlight
) -> None:
    metrics.track_in_flight(lambda: in_flight.count)
    metrics.track_endpoint_in_flight(
        lambda: ((e.role.value, e.url, e.legs.in_flight) for e in registry.all())
    )
