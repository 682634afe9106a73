"""The dashboard's live figures: windowed rates and TTFT quantiles from cumulative totals.

Pure: no I/O and no framework. It is fed cumulative totals, as read from pdproxy's own
Prometheus counter and histogram (``totals_from_samples``), at regular moments of an
injected clock, keeps the last few minutes of them, and answers with what Prometheus would
compute from the same series: rates from counter deltas, and quantiles from histogram
bucket deltas by ``histogram_quantile``'s linear interpolation.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

# Outcomes of pdproxy_requests_total that are not the proxy's or the fleet's failure.
NOT_ERRORS = frozenset({"ok", "client_disconnected"})

Buckets = tuple[tuple[float, float], ...]  # (upper bound, cumulative count), ascending, +Inf last


class Sample(Protocol):
    """One sample of a collected Prometheus metric (``prometheus_client.Sample``)."""

    @property
    def name(self) -> str: ...
    @property
    def labels(self) -> dict[str, str]: ...
    @property
    def value(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Totals:
    """Cumulative figures at one moment, summed over endpoints."""

    requests: Mapping[str, float] = field(default_factory=dict)  # outcome -> count
    ttft_buckets: Buckets = ()
    ttft_sum: float = 0.0

    @property
    def total(self) -> float:
        return sum(self.requests.values())

    @property
    def errors(self) -> float:
        return sum(n for outcome, n in self.requests.items() if outcome not in NOT_ERRORS)

    def since(self, earlier: Totals) -> Totals:
        """The increase from ``earlier`` to this; a series new since then counts from 0."""
        before = dict(earlier.ttft_buckets)
        return Totals(
            requests={
                outcome: max(0.0, n - earlier.requests.get(outcome, 0.0))
                for outcome, n in self.requests.items()
            },
            ttft_buckets=tuple(
                (le, max(0.0, n - before.get(le, 0.0))) for le, n in self.ttft_buckets
            ),
            ttft_sum=max(0.0, self.ttft_sum - earlier.ttft_sum),
        )


def totals_from_samples(
    requests: Iterable[Sample],
    ttft: Iterable[Sample],
    ttft_endpoints: Collection[str] | None = None,
) -> Totals:
    """``pdproxy_requests_total`` and ``pdproxy_request_ttft_seconds`` samples, summed over
    their ``endpoint`` label; the TTFT only over ``ttft_endpoints`` when given (the
    generation endpoints: a fast ``/tokenize`` would make generation look faster)."""
    by_outcome: dict[str, float] = {}
    for s in requests:
        if s.name.endswith("_total"):
            outcome = s.labels.get("outcome", "")
            by_outcome[outcome] = by_outcome.get(outcome, 0.0) + s.value
    by_le: dict[float, float] = {}
    ttft_sum = 0.0
    for s in ttft:
        if ttft_endpoints is not None and s.labels.get("endpoint") not in ttft_endpoints:
            continue
        if s.name.endswith("_bucket"):
            le = float(s.labels["le"])
            by_le[le] = by_le.get(le, 0.0) + s.value
        elif s.name.endswith("_sum"):
            ttft_sum += s.value
    return Totals(by_outcome, tuple(sorted(by_le.items())), ttft_sum)


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus's ``histogram_quantile``: the ``q``-quantile by linear interpolation in
    the bucket that holds it (the first bucket starts at 0); ``None`` with no observation.
    A quantile in the ``+Inf`` bucket is the highest finite upper bound."""
    if not buckets or not 0 <= q <= 1:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for upper_bound, count in buckets:
        if count >= rank:
            if math.isinf(upper_bound):
                return lower_bound
            in_bucket = count - lower_count
            if in_bucket <= 0:
                return upper_bound
            return lower_bound + (upper_bound - lower_bound) * (rank - lower_count) / in_bucket
        lower_bound, lower_count = upper_bound, count
    return lower_bound


@dataclass(frozen=True, slots=True)
class Figures:
    """What happened over one span of time."""

    seconds: float  # the span actually covered (shorter while history builds up)
    requests: float
    errors: float
    requests_per_second: float
    errors_per_second: float
    error_ratio: float | None  # errors / requests; None without requests
    ttft_p50: float | None  # seconds; None without a first byte in the span
    ttft_p99: float | None
    errors_by_outcome: dict[str, float]

    @classmethod
    def of(cls, delta: Totals, seconds: float) -> Figures:
        per_second = 1 / seconds if seconds > 0 else 0.0
        total, errors = delta.total, delta.errors
        return cls(
            seconds=seconds,
            requests=total,
            errors=errors,
            requests_per_second=total * per_second,
            errors_per_second=errors * per_second,
            error_ratio=errors / total if total else None,
            ttft_p50=histogram_quantile(0.5, delta.ttft_buckets),
            ttft_p99=histogram_quantile(0.99, delta.ttft_buckets),
            errors_by_outcome={
                outcome: n
                for outcome, n in sorted(delta.requests.items())
                if outcome not in NOT_ERRORS and n > 0
            },
        )


class FleetWindow:
    """The last ``history`` seconds of cumulative totals, recorded by the caller about every
    ``interval`` seconds, and at any moment in between. The newest record is always kept,
    but one that came less than half an interval after the record before it is replaced by
    the next, so extra records keep the figures current without crowding the history."""

    def __init__(
        self, clock: Callable[[], float], *, history: float = 300.0, interval: float = 1.0
    ) -> None:
        if history <= 0 or interval <= 0:
            raise ValueError("history and interval must be positive")
        self._clock = clock
        self.history = history
        self.interval = interval
        self._samples: deque[tuple[float, Totals]] = deque(
            maxlen=math.ceil(history / interval) * 2 + 2
        )

    def record(self, totals: Totals) -> None:
        now = self._clock()
        samples = self._samples
        if len(samples) >= 2 and samples[-1][0] - samples[-2][0] < self.interval / 2:
            samples.pop()
        self._samples.append((now, totals))
        while now - self._samples[0][0] > self.history + self.interval:
            self._samples.popleft()

    @property
    def latest(self) -> Totals:
        return self._samples[-1][1] if self._samples else Totals()

    def figures(self, seconds: float) -> Figures:
        """Over the last ``seconds`` up to the newest record (less while history is short)."""
        if len(self._samples) < 2:
            return Figures.of(Totals(), 0.0)
        newest_at, newest = self._samples[-1]
        then, earlier = self._at_or_before(newest_at - seconds)
        return Figures.of(newest.since(earlier), newest_at - then)

    def series(self, step: float) -> list[tuple[float, Figures]]:
        """Consecutive spans of about ``step`` seconds each, oldest first, ending at the
        newest record; each as (its end relative to the newest record, its figures)."""
        if len(self._samples) < 2:
            return []
        points: list[tuple[float, Figures]] = []
        newest_at = end_at = self._samples[-1][0]
        end = self._samples[-1][1]
        # Records come about every interval: take the one nearest a whole step back.
        shortest = max(step - self.interval / 2, 1e-9)
        for at, totals in reversed(self._samples):
            if end_at - at >= shortest:
                points.append((end_at - newest_at, Figures.of(end.since(totals), end_at - at)))
                end_at, end = at, totals
        points.reverse()
        return points

    def _at_or_before(self, moment: float) -> tuple[float, Totals]:
        """The newest record at or before ``moment``, or the oldest one."""
        for at, totals in reversed(self._samples):
            if at <= moment:
                return at, totals
        return self._samples[0]


def figures_dict(f: Figures) -> dict[str, Any]:
    """``Figures`` as the dashboard's JSON has them (seconds, per second, a 0..1 ratio)."""
    return {
        "seconds": round(f.seconds, 3),
        "requests": f.requests,
        "errors": f.errors,
        "requests_per_second": f.requests_per_second,
        "errors_per_second": f.errors_per_second,
        "error_ratio": f.error_ratio,
        "ttft_p50_seconds": f.ttft_p50,
        "ttft_p99_seconds": f.ttft_p99,
        "errors_by_outcome": f.errors_by_outcome,
    }


def series_dict(
    points: Sequence[tuple[float, Figures]], *, step: float, span: float
) -> dict[str, Any]:
    """Columns of the series, for sparklines: ``t`` is each point's end, in seconds
    relative to the newest record (0 or less), over at most ``span`` seconds."""
    return {
        "step_seconds": step,
        "span_seconds": span,
        "t": [round(t, 3) for t, _ in points],
        "requests_per_second": [_brief(f.requests_per_second) for _, f in points],
        "errors_per_second": [_brief(f.errors_per_second) for _, f in points],
        "ttft_p50_seconds": [_brief(f.ttft_p50) for _, f in points],
        "ttft_p99_seconds": [_brief(f.ttft_p99) for _, f in points],
    }


def _brief(x: float | None) -> float | None:
    """Four significant digits: plenty for a sparkline, and a third of the bytes."""
    return None if x is None else float(f"{x:.4g}")
