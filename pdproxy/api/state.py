"""What the handlers read: ``AppState``, one pdproxy's services, immutable and complete when
built (``pdproxy.build.build_state``), and ``InFlight``, the one counter they write."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry

from pdproxy.api.auth import ClientKeys
from pdproxy.config.proxy import ProxyConfig
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.membership.control_plane import ControlPlane
from pdproxy.membership.health import HealthChecker
from pdproxy.membership.kv_fleet import KVEventFleet
from pdproxy.membership.load_scraper import LoadScraper
from pdproxy.membership.membership import Membership
from pdproxy.membership.models import ModelReader
from pdproxy.membership.workers.link import OwnerLink
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.observability.multiproc import WorkerGauges
from pdproxy.observability.tracing import Tracer
from pdproxy.proxying.admission import Admission
from pdproxy.proxying.kv_release import KVRelease
from pdproxy.proxying.lifecycle import Lifecycle
from pdproxy.proxying.lora import LoraClient
from pdproxy.proxying.orchestrator import Orchestrator
from pdproxy.proxying.passthrough import Passthrough
from pdproxy.proxying.render_once import RenderOnce
from pdproxy.resilience.outlier import OutlierDetector
from pdproxy.upstream.engine_client import EngineClient


class InFlight:
    """The client requests this process is serving. Its one writer is
    ``pdproxy.api.openai``'s ``ServedEndpoint.__call__`` (``enter`` as a request arrives,
    ``leave`` as it ends); the drain (``Lifecycle``), the ``pdproxy_requests_in_flight``
    gauge and ``/status`` read ``count``."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def enter(self) -> None:
        self.count += 1

    def leave(self) -> None:
        self.count -= 1


@dataclass(frozen=True, slots=True)
class AppState:
    """One pdproxy's services, each built once at start-up; none is replaced afterwards."""

    config: ProxyConfig
    registry: EndpointRegistry
    client: EngineClient
    metrics: ProxyMetrics
    orchestrator: Orchestrator
    # what feeds and keeps the membership (started and closed as one); under --workers,
    # built but run only by the membership owner
    control: ControlPlane
    outliers: OutlierDetector
    release: KVRelease
    keys: ClientKeys
    lifecycle: Lifecycle
    lora: LoraClient  # vLLM's runtime LoRA API on one instance
    passthrough: Passthrough  # the endpoints served by one decode (pdproxy.wire.routes)
    clock: Callable[[], float]
    in_flight: InFlight  # client requests being served: the one mutable part
    tracer: Tracer  # --otlp-traces-endpoint; NullTracer without it
    admission: Admission | None  # None: no --max-concurrent-requests
    engine_authorization: str | None  # "Bearer <--engine-api-key>"
    render_once: RenderOnce | None  # --render-once
    kv_events: KVEventFleet | None  # --kv-events-endpoint: the engines' KV events
    # --workers N: this worker's link to the membership owner (the admin API's writes go
    # there) and the multiprocess registry /metrics renders; None in a single process.
    owner_link: OwnerLink | None
    exposition: CollectorRegistry | None
    worker_gauges: WorkerGauges | None
    # --registry-backend etcd://, or the owner's as it publishes it under --workers: the
    # shared registry's state for /status; None in-process
    registry_backend: Callable[[], dict[str, Any]] | None

    @property
    def membership(self) -> Membership:
        return self.control.membership

    @property
    def health(self) -> HealthChecker:
        return self.control.health

    @property
    def loads(self) -> LoadScraper:  # the engines' /metrics scrapes
        return self.control.loads

    @property
    def models(self) -> ModelReader:  # the engines' /v1/models re-reads
        return self.control.models
