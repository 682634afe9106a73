"""Fault tolerance: retries of a failed leg, active health checks (with the engines' load scrapes
and pre-warmed pairs) and passive health (ejection)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdproxy.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryConfig:
    """Retries of a failed leg on another instance, before the client's response starts.

    At most ``max_retries`` per request (0 turns retries off), and fleet-wide at most
    ``budget_ratio`` of the requests of the last ``budget_window`` seconds plus
    ``budget_min_per_sec``. Backoff applies only once every instance of a role was tried.
    """

    max_retries: int = 2
    # streams continued on another decode after a mid-stream cut, per request (0: off)
    migration_limit: int = 2
    budget_ratio: float = 0.2
    budget_window: float = 10.0
    budget_min_per_sec: float = 5.0
    initial_backoff: float = 0.05
    max_backoff: float = 1.0
    backoff_multiplier: float = 2.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ConfigError("--max-retries must be >= 0")
        if self.migration_limit < 0:
            raise ConfigError("--migration-limit must be >= 0")
        if self.budget_ratio < 0 or self.budget_min_per_sec < 0 or self.budget_window <= 0:
            raise ConfigError("the retry budget's ratio and floor must be >= 0, its window > 0")
        if not 0 <= self.initial_backoff <= self.max_backoff:
            raise ConfigError("retry backoff: need 0 <= initial <= max")
        if self.backoff_multiplier < 1 or not 0 <= self.jitter <= 1:
            raise ConfigError("retry backoff: multiplier >= 1 and jitter in [0, 1]")


@dataclass(frozen=True, slots=True, kw_only=True)
class HealthConfig:
    """Active health checks: ``GET endpoint`` on every instance each ``interval`` seconds
    (0 turns them off), on the probe pool; and, on the same pool, a scrape of every
    instance's ``/metrics`` for its load each ``engine_metrics_interval`` seconds (0: off)."""

    interval: float = 5.0
    timeout: float = 2.0
    failure_threshold: int = 3
    success_threshold: int = 2
    endpoint: str = "/health"
    engine_metrics_interval: float = 1.0
    # seconds between re-reads of every instance's /v1/models (its models and adapters; 0: off)
    models_interval: float = 30.0
    max_models: int = 1024  # models (and adapters) one instance may list in /v1/models
    # pre-warmed pairs (``pdproxy.membership.warmup``): a new instance first runs one tiny PD
    # request with up to ``warm_pairs`` peers of the other role (0: off), for at most
    # ``warm_timeout``
    warm_pairs: int = 0
    warm_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.interval < 0 or self.timeout <= 0:
            raise ConfigError("health check interval must be >= 0 and its timeout > 0")
        if not 0 <= self.engine_metrics_interval < math.inf:
            raise ConfigError("--engine-metrics-interval-secs must be >= 0")
        if not 1 <= self.max_models <= 1_000_000:
            raise ConfigError("--max-models-per-instance must be in 1-1000000")
        if not 0 <= self.models_interval < math.inf:
            raise ConfigError("--models-refresh-secs must be >= 0")
        if self.failure_threshold < 1 or self.success_threshold < 1:
            raise ConfigError("health check thresholds must be >= 1")
        if not self.endpoint.startswith("/"):
            raise ConfigError("--health-check-endpoint must start with /")
        if self.warm_pairs < 0 or self.warm_timeout <= 0:
            raise ConfigError("--warm-pairs must be >= 0 and --warm-timeout-secs > 0")

    @property
    def enabled(self) -> bool:
        return self.interval > 0


@dataclass(frozen=True, slots=True, kw_only=True)
class OutlierConfig:
    """Passive health: ejection after ``consecutive_failures`` failed legs (0 turns it off)
    for ``base_ejection`` seconds, doubling up to ``max_ejection``."""

    consecutive_failures: int = 3
    base_ejection: float = 5.0
    max_ejection: float = 60.0
    max_ejection_percent: float = 50.0
    overload_cooldown: float = 1.0  # after a 429/408, peers first for this long (0: off)

    def __post_init__(self) -> None:
        if self.overload_cooldown < 0:
            raise ConfigError("--overload-cooldown-secs must be >= 0")
        if self.consecutive_failures < 0:
            raise ConfigError("--outlier-consecutive-failures must be >= 0")
        if not 0 < self.base_ejection <= self.max_ejection:
            raise ConfigError("ejection times: need 0 < base <= max")
        if not 0 <= self.max_ejection_percent <= 100:
            raise ConfigError("--max-ejection-percent must be in 0-100")
