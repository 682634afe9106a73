"""All of pdproxy's Prometheus metrics, on an injected registry (``pdproxy_`` prefix)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LEG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
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
        self.in_flight = Gauge(
            "pdproxy_requests_in_flight",
            "Client requests being served.",
            registry=registry,
        )
        self._request_children: dict[tuple[str, str], Any] = {}
        self.kv_params_missing = Counter(
            "pdproxy_kv_params_missing_total",
            "Prefill answers that carried no kv_transfer_params (the decode recomputed).",
            registry=registry,
        )
        self.registry_messages = Counter(
            "pdproxy_registry_messages_total",
            "ZMQ registry messages by outcome.",
            ("outcome",),
            registry=registry,
        )
        self.endpoints = Gauge(
            "pdproxy_endpoints",
            "Known engine instances by role and state.",
            ("role", "state"),
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

    def track_in_flight(self, read: Callable[[], float]) -> None:
        """The in-flight gauge reads the live count at scrape time, costing nothing per request."""
        self.in_flight.set_function(read)
