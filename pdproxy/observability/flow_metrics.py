"""The metrics of flow control (``--tenants``, docs/flow-control.md): the ``pdproxy_flow_*``
series and the time-to-first-token prediction's error, read and written by
``pdproxy.observability.flow_book``."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class FlowMetrics:
    """Flow control (``--tenants``): who waits where, for how long, who is refused,
    who meets its deadline, and how good the time-to-first-token prediction is. The
    ``tenant`` label takes the tenants file's names (and ``default``), ``priority`` its
    priorities (and 0; any other band is ``other``): bounded by the file. The histograms
    take ``buckets`` (seconds), those of pdproxy's other latency histograms."""

    def __init__(self, registry: CollectorRegistry, buckets: Sequence[float]) -> None:
        self.waiting = Gauge(
            "pdproxy_flow_waiting",
            "Requests waiting now, by stage (admission, prefill, decode), priority and tenant.",
            ("stage", "priority", "tenant"),
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.wait_seconds = Histogram(
            "pdproxy_flow_wait_seconds",
            "Time requests waited, by stage (admission, prefill, decode), priority and tenant.",
            ("stage", "priority", "tenant"),
            registry=registry,
            buckets=buckets,
        )
        self.refused = Counter(
            "pdproxy_flow_refused_total",
            "Requests refused with 429 by flow control, by tenant and reason (deadline,"
            " rate_limit, tenant_concurrency, queue_full, queue_timeout).",
            ("tenant", "reason"),
            registry=registry,
        )
        self.slo = Counter(
            "pdproxy_flow_slo_total",
            "Requests with x-slo-ttft-ms that were answered, by tenant, priority and outcome"
            " (met: first byte within the deadline; missed).",
            ("tenant", "priority", "outcome"),
            registry=registry,
        )
        self.ttft_prediction_error = Histogram(
            "pdproxy_ttft_prediction_error_seconds",
            "How far the predicted time to first token of a request with a deadline was"
            " from the measured one (absolute), seconds.",
            registry=registry,
            buckets=buckets,
        )
