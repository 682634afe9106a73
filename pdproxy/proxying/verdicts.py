"""Leg outcomes → passive health: each leg's result is judged once, here.

A failure that is the instance's fault (connect, timeout, reset, 5xx) counts toward its
ejection; an engine's 429 or 408 never does, but sends new requests to its peers for a
short cool-down; any other answer, 4xx included, proves the engine alive and counts as a
success. A leg the client abandoned gives no verdict. Every failed leg is counted on its
instance (``pdproxy_endpoint_failures_total``) by its retry reason, else ``4xx`` or ``other``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pdproxy.errors import ProxyError, UpstreamStatusError
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.resilience.outlier import OutlierDetector
from pdproxy.resilience.retry import counts_against, retry_reason
from pdproxy.types import Endpoint, Role

logger = logging.getLogger(__name__)


class Verdicts:
    def __init__(
        self,
        outliers: OutlierDetector,
        registry: EndpointRegistry,
        metrics: ProxyMetrics,
        peers: Callable[[Endpoint], tuple[Endpoint, ...]] | None = None,
    ) -> None:
        self.outliers = outliers
        self._registry = registry
        self._peers = peers or self._role_peers
        self._metrics = metrics

    def success(self, endpoint: Endpoint) -> None:
        self.outliers.on_success(endpoint)

    def abandoned(self, endpoint: Endpoint) -> None:
        self.outliers.on_abandoned(endpoint)

    def judge(self, endpoint: Endpoint, error: ProxyError) -> str | None:
        """Record a failed leg; returns its retry reason (None: not retry-safe)."""
        reason = retry_reason(error)
        self._metrics.count_leg_failure(
            endpoint.role.value, endpoint.url, reason or _other_reason(error)
        )
        if reason is None:
            self.success(endpoint)
        elif counts_against(reason):
            self.failure(endpoint, reason)
        else:
            self.outliers.on_overloaded(endpoint)
        return reason

    def _role_peers(self, endpoint: Endpoint) -> tuple[Endpoint, ...]:
        snapshot = self._registry.snapshot()
        return snapshot.prefill if endpoint.role is Role.PREFILL else snapshot.decode

    def untrusted(self, endpoint: Endpoint, reason: str) -> None:
        """A leg already judged a success answered what cannot be trusted: a failure."""
        self._metrics.count_leg_failure(endpoint.role.value, endpoint.url, reason)
        self._ejected(endpoint, reason, self.outliers.on_untrusted(endpoint, self._peers(endpoint)))

    def failure(self, endpoint: Endpoint, reason: str) -> None:
        self._ejected(endpoint, reason, self.outliers.on_failure(endpoint, self._peers(endpoint)))

    def _ejected(self, endpoint: Endpoint, reason: str, ejected: bool) -> None:
        if ejected:
            self._metrics.ejections.labels(endpoint.role.value, endpoint.url).inc()
            logger.warning(
                "ejected %s %s after %d failures (last: %s), ejection #%d",
                endpoint.role.value,
                endpoint.url,
                endpoint.health.consecutive_failures,
                reason,
                endpoint.health.ejections,
            )


def _other_reason(error: ProxyError) -> str:
    """The failure label of a leg that is not retry-safe."""
    if isinstance(error, UpstreamStatusError):
        return f"{error.engine_status // 100}xx"  # 4xx (3xx in theory): bounded
    return "other"
