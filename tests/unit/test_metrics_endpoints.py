"""Per-instance series: counted per leg with cached children, read live at scrape time,
and removed with the instance, so the label set stays bounded by the fleet."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from pdproxy.observability.metrics import ProxyMetrics

P, D = ("prefill", "http://p:1"), ("decode", "http://d:2")


def _metrics() -> tuple[ProxyMetrics, list[tuple[str, str, int]]]:
    live: list[tuple[str, str, int]] = []
    metrics = ProxyMetrics(CollectorRegistry())
    metrics.track_endpoint_in_flight(lambda: list(live))
    return metrics, live


def _sample(metrics: ProxyMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def test_legs_and_failures_are_counted_per_instance():
    metrics, _ = _metrics()
    for _ in range(3):
        metrics.count_leg(*D)
    metrics.count_leg_failure(*D, "5xx")
    metrics.count_leg_failure(*D, "5xx")
    assert _sample(metrics, "pdproxy_endpoint_requests_total", role="decode", url=D[1]) == 3
    assert (
        _sample(metrics, "pdproxy_endpoint_failures_total", role="decode", url=D[1], reason="5xx")
        == 2
    )


def test_in_flight_is_read_at_scrape_time():
    metrics, live = _metrics()
    live.append((*P, 2))
    assert _sample(metrics, "pdproxy_endpoint_in_flight", role="prefill", url=P[1]) == 2
    live[0] = (*P, 0)
    assert _sample(metrics, "pdproxy_endpoint_in_flight", role="prefill", url=P[1]) == 0
    live.clear()
    assert b"pdproxy_endpoint_in_flight{" not in generate_latest(metrics.registry)


def test_a_departed_instances_series_are_removed():
    metrics, _ = _metrics()
    metrics.count_leg(*P)
    metrics.count_leg(*D)
    metrics.count_leg_failure(*D, "connect")
    metrics.set_endpoint_health([(*P, True, False)])  # D has left the fleet
    text = generate_latest(metrics.registry).decode()
    assert D[1] not in text and P[1] in text
    metrics.count_leg(*D)  # a leg still in flight when it left: counted afresh
    assert _sample(metrics, "pdproxy_endpoint_requests_total", role="decode", url=D[1]) == 1


def test_client_latency_is_observed_per_endpoint():
    metrics, _ = _metrics()
    metrics.observe_request("/v1/completions", 0.02, 0.5)
    metrics.observe_request("/v1/completions", 0.04, 0.7)
    count = "pdproxy_request_ttft_seconds_count"
    assert _sample(metrics, count, endpoint="/v1/completions") == 2
    total = _sample(metrics, "pdproxy_request_duration_seconds_sum", endpoint="/v1/completions")
    assert total is not None and abs(total - 1.2) < 1e-9
