"""The one typed object the app keeps on ``app.state``; built by ``create_app``."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from pdproxy.api.auth import ClientKeys
from pdproxy.config.proxy import ProxyConfig
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.membership.health import HealthChecker
from pdproxy.membership.kv_fleet import KVEventFleet
from pdproxy.membership.load_scraper import LoadScraper
from pdproxy.membership.membership import Membership
from pdproxy.membership.models import ModelReader
from pdproxy.membership.workers.link import OwnerLink
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.observability.multiproc import WorkerGauges
from pdproxy.observability.tracing import NullTracer, Tracer
from pdproxy.proxying.admission import Admission
from pdproxy.proxying.kv_release import KVRelease
from pdproxy.proxying.lifecycle import Lifecycle
from pdproxy.proxying.lora import LoraClient
from pdproxy.proxying.orchestrator import Orchestrator
from pdproxy.proxying.passthrough import Passthrough
from pdproxy.proxying.render_once import RenderOnce
from pdproxy.resilience.outlier import OutlierDetector
from pdproxy.upstream.engine_client import EngineClient


@dataclass(slots=True)
class AppState:
    config: ProxyConfig
    registry: EndpointRegistry
    client: EngineClient
    metrics: ProxyMetrics
    orchestrator: Orchestrator
    membership: Membership
    health: HealthChecker
    outliers: OutlierDetector
    release: KVRelease
    keys: ClientKeys
    lifecycle: Lifecycle
    loads: LoadScraper  # the engines' /metrics scrapes
    models: ModelReader  # the engines' /v1/models re-reads
    lora: LoraClient  # vLLM's runtime LoRA API on one instance
    passthrough: Passthrough  # the endpoints served by one decode (pdproxy.wire.routes)
    clock: Callable[[], float] = time.monotonic
    admission: Admission | None = None  # None: no --max-concurrent-requests
    engine_authorization: str | None = None  # "Bearer <--engine-api-key>"
    in_flight: int = 0  # client requests being served
    tracer: Tracer = field(default_factory=NullTracer)  # --otlp-traces-endpoint
    render_once: RenderOnce | None = None  # --render-once
    kv_events: KVEventFleet | None = None  # --kv-events-endpoint: the engines' KV events
    # --workers N: this worker's link to the membership owner (the admin API's writes go
    # there) and the multiprocess registry /metrics renders; None in a single process.
    owner_link: OwnerLink | None = None
    exposition: CollectorRegistry | None = None
    worker_gauges: WorkerGauges | None = None
    # --registry-backend etcd://: the shared registry's state for /status; None in-process
    registry_backend: Callable[[], dict[str, Any]] | None = None
