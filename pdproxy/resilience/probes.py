"""Active health verdicts: consecutive probe results against thresholds (vllm-router's).

An instance that has never answered is ``UNKNOWN`` and not routable; its first answer
makes it healthy. A healthy one turns unhealthy after ``failure_threshold`` failed probes
in a row, and healthy again after ``success_threshold`` successes in a row.
"""

from __future__ import annotations

from pdproxy.config.resilience import HealthConfig
from pdproxy.types import EndpointHealth, ProbeState


def apply_probe(health: EndpointHealth, ok: bool, config: HealthConfig) -> ProbeState | None:
    """Record one probe result; returns the new state when it changed, else None."""
    if ok:
        health.probe_failures = 0
        health.probe_successes += 1
        recovered = (
            health.probe is ProbeState.UNKNOWN or health.probe_successes >= config.success_threshold
        )
        new = ProbeState.HEALTHY if recovered else health.probe
    else:
        health.probe_successes = 0
        health.probe_failures += 1
        failed = health.probe_failures >= config.failure_threshold
        new = ProbeState.UNHEALTHY if failed else health.probe
    if new is health.probe:
        return None
    health.probe = new
    return new
