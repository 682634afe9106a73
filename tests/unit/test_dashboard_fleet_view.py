"""The dashboard's windowed figures (pdproxy.observability.fleet_view): pure, against a fake
clock."""

from __future__ import annotations

import itertools
import math

import pytest
from prometheus_client import CollectorRegistry

from pdproxy.api.dashboard import read_totals
from pdproxy.observability.fleet_view import (
    FleetWindow,
    Totals,
    histogram_quantile,
    series_dict,
    totals_from_samples,
)
from pdproxy.observability.metrics import ProxyMetrics

INF = math.inf


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def buckets(*pairs: tuple[float, float]) -> tuple[tuple[float, float], ...]:
    return tuple(pairs)


@pytest.mark.parametrize(
    ("q", "hist", "expected"),
    [
        # no observation at all
        (0.5, buckets(), None),
        (0.5, buckets((0.1, 0), (INF, 0)), None),
        # all in the first bucket: interpolated from 0
        (0.5, buckets((0.1, 10), (1.0, 10), (INF, 10)), 0.05),
        # all in (0.025, 0.05]: p50 and p99 inside it
        (0.5, buckets((0.025, 0), (0.05, 100), (INF, 100)), 0.0375),
        (0.99, buckets((0.025, 0), (0.05, 100), (INF, 100)), 0.025 + 0.025 * 0.99),
        # half fast, half slow: the median at the first bucket's top
        (0.5, buckets((0.1, 50), (1.0, 100), (INF, 100)), 0.1),
        (0.75, buckets((0.1, 50), (1.0, 100), (INF, 100)), 0.55),
        # in +Inf: the highest finite bound, as Prometheus answers
        (0.99, buckets((0.1, 50), (1.0, 50), (INF, 100)), 1.0),
        # out of range
        (1.5, buckets((0.1, 10), (INF, 10)), None),
    ],
)
def test_histogram_quantile(q, hist, expected):
    got = histogram_quantile(q, hist)
    if expected is None:
        assert got is None
    else:
        assert got == pytest.approx(expected)


def test_totals_from_the_metric_objects_sum_over_endpoints():
    metrics = ProxyMetrics(CollectorRegistry())
    metrics.count_request("/v1/completions", "ok")
    metrics.count_request("/v1/chat/completions", "ok")
    metrics.count_request("/v1/completions", "UpstreamConnectError")
    metrics.count_request("/v1/completions", "client_disconnected")
    metrics.ttft_seconds.labels("/v1/completions").observe(0.02)
    metrics.ttft_seconds.labels("/v1/chat/completions").observe(0.2)

    totals = read_totals(metrics)

    assert totals.requests == {"ok": 2, "UpstreamConnectError": 1, "client_disconnected": 1}
    assert totals.total == 4
    assert totals.errors == 1  # a client that left is not an error
    by_le = dict(totals.ttft_buckets)
    assert by_le[0.025] == 1 and by_le[0.25] == 2 and by_le[INF] == 2
    assert totals.ttft_sum == pytest.approx(0.22)
    assert [le for le, _ in totals.ttft_buckets] == sorted(by_le)


def test_totals_from_samples_ignores_created_series():
    class S:
        def __init__(self, name, labels, value):
            self.name, self.labels, self.value = name, labels, value

    totals = totals_from_samples(
        [S("pdproxy_requests_total", {"outcome": "ok"}, 3), S("pdproxy_requests_created", {}, 9)],
        [S("x_bucket", {"le": "+Inf"}, 2), S("x_count", {}, 2), S("x_created", {}, 9)],
    )
    assert totals.requests == {"ok": 3}
    assert totals.ttft_buckets == ((INF, 2),)


def totals(ok: float, errors: float = 0, fast: float = 0, slow: float = 0) -> Totals:
    """Cumulative: ``fast`` first bytes within 0.1 s, ``slow`` within 1 s."""
    n = fast + slow
    return Totals(
        requests={"ok": ok, "ServiceUnavailableError": errors},
        ttft_buckets=((0.1, fast), (1.0, n), (INF, n)),
    )


def test_figures_are_deltas_over_the_window():
    clock = Clock()
    window = FleetWindow(clock, history=300, interval=1)
    for second in range(121):  # 2 ok requests a second, one error every 10 s
        clock.now = 1000.0 + second
        window.record(totals(ok=2 * second, errors=second // 10, fast=2 * second))

    f = window.figures(60)

    assert f.seconds == 60
    assert f.requests_per_second == pytest.approx((120 + 6) / 60)
    assert f.errors_per_second == pytest.approx(6 / 60)
    assert f.error_ratio == pytest.approx(6 / 126)
    assert f.errors_by_outcome == {"ServiceUnavailableError": 6}
    assert f.ttft_p50 == pytest.approx(0.05)


def test_window_reports_the_span_it_really_covers_while_history_is_short():
    clock = Clock()
    window = FleetWindow(clock)
    assert window.figures(60).requests == 0  # nothing recorded yet
    window.record(Totals())
    clock.now += 5
    window.record(totals(ok=10, slow=10))

    f = window.figures(60)

    assert f.seconds == 5
    assert f.requests_per_second == 2
    assert f.ttft_p50 == pytest.approx(0.55)
    assert f.error_ratio == 0


def test_no_requests_means_no_ratio_and_no_quantile():
    clock = Clock()
    window = FleetWindow(clock)
    window.record(totals(ok=5, fast=5))
    clock.now += 10
    window.record(totals(ok=5, fast=5))

    f = window.figures(60)

    assert f.requests_per_second == 0
    assert f.error_ratio is None
    assert f.ttft_p50 is None and f.ttft_p99 is None


def test_extra_records_keep_the_newest_current_without_crowding_history():
    clock = Clock()
    window = FleetWindow(clock, history=10, interval=1)
    window.record(Totals())  # the baseline is never replaced
    for i in range(1, 50):  # ten records a second
        clock.now += 0.1
        window.record(totals(ok=i))

    assert window.latest.requests["ok"] == 49
    samples = list(window._samples)
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(samples[:-1])]  # the newest may be close
    assert all(gap >= 0.5 - 1e-9 for gap in gaps), gaps
    assert len(samples) <= 12


def test_history_is_bounded():
    clock = Clock()
    window = FleetWindow(clock, history=30, interval=1)
    for second in range(200):
        clock.now = 1000.0 + second
        window.record(totals(ok=second))
    assert clock.now - window._samples[0][0] <= 31
    assert window.figures(300).seconds <= 31


def test_series_has_one_point_per_step_ending_now():
    clock = Clock()
    window = FleetWindow(clock, history=60, interval=1)
    for second in range(61):  # 1 req/s for 30 s, then 3 req/s
        clock.now = 1000.0 + second
        ok = second if second <= 30 else 30 + 3 * (second - 30)
        window.record(totals(ok=ok, fast=ok))

    points = window.series(5)

    assert len(points) == 12
    assert [t for t, _ in points] == [-55, -50, -45, -40, -35, -30, -25, -20, -15, -10, -5, 0]
    rates = [f.requests_per_second for _, f in points]
    assert rates[:6] == [1] * 6 and rates[6:] == [3] * 6
    assert all(f.seconds == 5 for _, f in points)


def test_series_marks_spans_without_first_bytes():
    clock = Clock()
    window = FleetWindow(clock, history=60, interval=1)
    for second in range(11):
        clock.now = 1000.0 + second
        window.record(totals(ok=0))
    assert [f.ttft_p99 for _, f in window.series(5)] == [None, None]
    assert FleetWindow(clock).series(5) == []


def test_a_series_new_since_the_baseline_counts_from_zero():
    later = Totals(requests={"ok": 3, "BadGatewayError": 2}, ttft_buckets=((0.1, 3), (INF, 3)))
    delta = later.since(Totals())
    assert delta.requests == {"ok": 3, "BadGatewayError": 2}
    assert delta.ttft_buckets == ((0.1, 3), (INF, 3))


def test_window_rejects_nonsense():
    with pytest.raises(ValueError):
        FleetWindow(Clock(), history=0)


def test_series_columns_keep_zeros_and_gaps_apart():
    clock = Clock()
    window = FleetWindow(clock, history=60, interval=1)
    for second, ok in enumerate([0, 0, 0, 0, 7, 14, 21]):
        clock.now = 1000.0 + second
        window.record(totals(ok=ok, fast=ok))

    columns = series_dict(window.series(2), step=2, span=60)

    assert columns["step_seconds"] == 2 and columns["span_seconds"] == 60
    assert columns["t"] == [-4, -2, 0]
    assert columns["requests_per_second"] == [0, 3.5, 7]  # a quiet span is 0, not a gap
    assert columns["ttft_p50_seconds"][0] is None  # no first byte: a gap
    assert columns["ttft_p50_seconds"][2] == 0.05
    assert columns["errors_per_second"] == [0, 0, 0]


def test_ttft_counts_only_the_endpoints_asked_for():
    from prometheus_client import CollectorRegistry, Histogram

    registry = CollectorRegistry()
    ttft = Histogram("t_seconds", "t", ("endpoint",), registry=registry, buckets=(0.01, 1.0))
    ttft.labels("/v1/completions").observe(0.5)
    ttft.labels("/tokenize").observe(0.001)
    samples = [s for metric in ttft.collect() for s in metric.samples]
    every = totals_from_samples([], samples)
    generation = totals_from_samples([], samples, ("/v1/completions",))
    assert every.ttft_buckets[-1][1] == 2 and generation.ttft_buckets[-1][1] == 1
    assert generation.ttft_buckets[0][1] == 0  # the fast /tokenize is not in it
