"""Latency figures the timing tests assert on."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def p99(samples: Sequence[float]) -> float:
    """The 99th percentile by linear interpolation between the closest ranks (numpy's
    default, R's type 7).

    ``statistics.quantiles``' default method puts the 99th percentile of fewer than 99
    samples at their maximum, so over a hostile case's 80 probes one scheduler hiccup of
    the shared two-core machine decided the test; here it takes one sample in a hundred to
    move it. A slow path pdproxy takes on every attack still shows in many samples.
    """
    if len(samples) == 1:
        return samples[0]
    return statistics.quantiles(samples, n=100, method="inclusive")[98]
