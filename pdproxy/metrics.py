"""All of pdproxy's Prometheus metrics, on an injected registry (``pdproxy_`` prefix)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LEG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._request_children: dict[tuple[str, str], Any] = {}
        self._endpoint_labels: set[tuple[str, str]] = set()
        self._define_requests(registry)
        self._define_fleet(registry)
        self._define_resilience(registry)
        self._define_admission(registry)

    def _define_requests(self, registry: CollectorRegistry) -> None:
        """Client requests and their legs."""
        self.requests = Counter(
            "pdproxy_requests_total",
            "Client requests by endpoint and outcome (ok, client_disconnected, or the error type,"
            " mid-stream failures included).",
            ("endpoint", "outcome"),
            registry=registry,
        )
        self.prefill_seconds = Histogram(
            "pdproxy_prefill_duration_seconds",
            "Time from sending the prefill leg to its full answer.",
            registry=registry,
            buckets=_LEG_BUCKETS,
        )
        self.ttft_seconds = Histogram(
            "pdproxy_request_ttft_seconds",
            "Client's time to first byte: from the request's arrival to the first body byte"
            " sent back (the first SSE event of a stream, the whole body otherwise).",
            ("endpoint",),
            registry=registry,
            buckets=_LEG_BUCKETS,
        )
        self.request_seconds = Histogram(
            "pdproxy_request_duration_seconds",
            "Client's end-to-end time: from the request's arrival to its last byte.",
            ("endpoint",),
            registry=registry,
            buckets=_LEG_BUCKETS,
        )
        self.in_flight = Gauge(
            "pdproxy_requests_in_flight",
            "Client requests being served.",
            registry=registry,
        )
        self.kv_params_missing = Counter(
            "pdproxy_kv_params_missing_total",
            "Prefill answers that carried no kv_transfer_params (the decode recomputed).",
            registry=registry,
        )

    def _define_fleet(self, registry: CollectorRegistry) -> None:
        """Engine instances and the registry."""
        self.registry_messages = Counter(
            "pdproxy_registry_messages_total",
            "ZMQ registry messages by outcome.",
            ("outcome",),
            registry=registry,
        )
        self.registry_refused = Counter(
            "pdproxy_registry_refused_total",
            "Connections to the ZMQ registry refused: the peer is outside --registry-allow-cidr.",
            registry=registry,
        )
        self.registry_mutes = Counter(
            "pdproxy_registry_mutes_total",
            "ZMQ registry peers muted for sending malformed messages too fast (their messages"
            ' are then counted in pdproxy_registry_messages_total{outcome="muted"}).',
            registry=registry,
        )
        self.endpoints = Gauge(
            "pdproxy_endpoints",
            "Known engine instances by role and state.",
            ("role", "state"),
            registry=registry,
        )
        self.endpoint_healthy = Gauge(
            "pdproxy_endpoint_healthy",
            "1 while an instance passes its active health checks, else 0.",
            ("role", "url"),
            registry=registry,
        )
        self.endpoint_ejected = Gauge(
            "pdproxy_endpoint_ejected",
            "1 while an instance is ejected (breaker open or half-open), else 0.",
            ("role", "url"),
            registry=registry,
        )

    def _define_resilience(self, registry: CollectorRegistry) -> None:
        """Retries, ejections and released KV."""
        self.retries = Counter(
            "pdproxy_retries_total",
            "Legs retried on another instance before the client's response started, by leg"
            " and the failure that caused the retry (connect, timeout, reset, 5xx, 429, 408).",
            ("leg", "reason"),
            registry=registry,
        )
        self.retry_budget_exhausted = Counter(
            "pdproxy_retry_budget_exhausted_total",
            "Retry-safe leg failures that were not retried because the retry budget was spent.",
            ("leg",),
            registry=registry,
        )
        self.ejections = Counter(
            "pdproxy_ejections_total",
            "Instances taken out of rotation by outlier ejection (passive health).",
            ("role", "url"),
            registry=registry,
        )
        self.released_kv = Counter(
            "pdproxy_released_kv_total",
            "Prefills whose KV no decode would read, released early on the engines, by outcome.",
            ("outcome",),
            registry=registry,
        )

    def _define_admission(self, registry: CollectorRegistry) -> None:
        """Admission control."""
        self.queue_depth = Gauge(
            "pdproxy_queue_depth",
            "Client requests waiting for an admission slot (--max-concurrent-requests).",
            registry=registry,
        )
        self.admission_rejected = Counter(
            "pdproxy_admission_rejected_total",
            "Client requests refused with 429 by admission control, by reason"
            " (queue_full, queue_timeout).",
            ("reason",),
            registry=registry,
        )

    def count_request(self, endpoint: str, outcome: str) -> None:
        """Hot path: label children are cached, as ``labels()`` takes a lock per call."""
        child = self._request_children.get((endpoint, outcome))
        if child is None:
            child = self._request_children[(endpoint, outcome)] = self.requests.labels(
                endpoint, outcome
            )
        child.inc()

    def count_retry(self, leg: str, reason: str) -> None:
        self.retries.labels(leg, reason).inc()

    def set_endpoint_health(self, rows: Iterable[tuple[str, str, bool, bool]]) -> None:
        """Per-instance gauges from ``(role, url, healthy, ejected)``; departed instances'
        series are removed so the label set stays bounded by the fleet."""
        seen = set()
        for role, url, healthy, ejected in rows:
            seen.add((role, url))
            self.endpoint_healthy.labels(role, url).set(1 if healthy else 0)
            self.endpoint_ejected.labels(role, url).set(1 if ejected else 0)
        for labels in self._endpoint_labels - seen:
            self.endpoint_healthy.remove(*labels)
            self.endpoint_ejected.remove(*labels)
        self._endpoint_labels = seen

    def track_in_flight(self, read: Callable[[], float]) -> None:
        """The in-flight gauge reads the live count at scrape time, costing nothing per request."""
        self.in_flight.set_function(read)
