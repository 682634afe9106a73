"""What every part of one pdproxy shares: the registry, the upstream client, the metrics, the
KV connector, the health book, the LoRA client and flow control."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from pdproxy.config.proxy import ProxyConfig
from pdproxy.connectors import KVConnector, load_connector
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.membership.identity import relabel
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.proxying.admission import Admission
from pdproxy.proxying.leg_counts import forget_kv_sources
from pdproxy.proxying.lora import LoraClient
from pdproxy.proxying.verdicts import Verdicts
from pdproxy.resilience.outlier import OutlierDetector
from pdproxy.upstream.engine_client import EngineClient


@dataclass(frozen=True, slots=True)
class Core:
    """What every part of the state shares."""

    registry: EndpointRegistry
    client: EngineClient
    metrics: ProxyMetrics
    connector: KVConnector
    outliers: OutlierDetector
    lora: LoraClient
    admission: Admission | None  # --max-concurrent-requests or --tenants; None: neither
    verdicts: Verdicts  # every leg's outcome judged once, on the fleet's instances


def build_core(
    config: ProxyConfig, clock: Callable[[], float], metrics_registry: CollectorRegistry
) -> Core:
    registry = EndpointRegistry(clock)
    client = EngineClient(
        config.timeouts, config.pool, bearer(config.engine_api_key), tls=config.engine_tls
    )
    metrics = ProxyMetrics(metrics_registry)
    outliers = OutlierDetector(config.outlier, clock)
    core = Core(
        registry=registry,
        client=client,
        metrics=metrics,
        connector=load_connector(config),
        outliers=outliers,
        lora=LoraClient(relabel=functools.partial(relabel, registry), client=client),
        admission=_admission(config, metrics, clock),
        verdicts=Verdicts(outliers, registry, metrics),
    )
    core.outliers.on_connections_lost(forget_kv_sources)  # the legs' record, the book's news
    core.registry.on_replace(forget_kv_sources)  # a replacement starts with no KV sources
    return core


def bearer(key: str | None) -> str | None:
    return None if key is None else f"Bearer {key}"


def _admission(
    config: ProxyConfig, metrics: ProxyMetrics, clock: Callable[[], float]
) -> Admission | None:
    if not (config.admission.enabled or config.tenants.enabled):
        return None
    return Admission(config.admission, metrics, config.tenants, clock)
