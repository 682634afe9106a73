"""The retry run both request paths share: a leg that failed before anything reached the
client is retried on another instance of its role.

A failure is retried only when it is retry-safe (``resilience.retry``), within
``--max-retries`` per request and the fleet-wide retry budget; the next instance is one this
request has not tried yet, and once every instance of the role was tried, the next pass
waits an exponential backoff with jitter and may take anyone but the last to fail. The
callers keep what one attempt does: the orchestrator's pair of legs (with its prefill reuse
and KV release) and decode-only requests, the pass-through's one leg. The first attempt
never enters this module beyond its pick: the retry run starts on the first failure.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from pdproxy.config.resilience import RetryConfig
from pdproxy.errors import NoEndpointAvailable, UpstreamError
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.resilience.outlier import OutlierDetector
from pdproxy.resilience.retry import Backoff, RetryBudget, retry_reason
from pdproxy.scheduling.context import RequestFeatures
from pdproxy.scheduling.scheduler import Scheduler
from pdproxy.types import Endpoint, Role

logger = logging.getLogger(__name__)

T = TypeVar("T")
Pick = tuple[Endpoint, int | None]  # an instance and its DP rank


@dataclass(slots=True)
class RetryRun:
    """One request's scheduling features and retry state (the failures' maps fill only
    once a leg failed)."""

    features: RequestFeatures
    retries_left: int
    tried: dict[Role, set[str]] = field(default_factory=dict)  # this pass's, per role
    last_failed: dict[Role, str] = field(default_factory=dict)
    rounds: int = 0  # passes over an exhausted role, for the backoff
    trials: list[Endpoint] | None = None  # the half-open trials it took


class Retries:
    def __init__(
        self,
        *,
        scheduler: Scheduler,
        outliers: OutlierDetector,
        pool: Callable[[Role, str | None], tuple[Endpoint, ...]],
        retry: RetryConfig,
        budget: RetryBudget,
        metrics: ProxyMetrics,
        rng: random.Random,
    ) -> None:
        self._scheduler = scheduler
        self._outliers = outliers
        self._pool = pool  # the instances of a role (serving a model) retries choose among
        self._max_retries = retry.max_retries
        self._backoff = Backoff(
            retry.initial_backoff, retry.max_backoff, retry.backoff_multiplier, retry.jitter
        )
        self._budget = budget
        self._metrics = metrics
        self._rng = rng

    def pool(self, role: Role, model: str | None) -> tuple[Endpoint, ...]:
        """The instances of ``role`` serving ``model`` that picks and retries choose among."""
        return self._pool(role, model)

    def begin(self) -> int:
        """Count a new request toward the fleet-wide budget; returns its retries allowed."""
        self._budget.on_request()
        return self._max_retries

    def pick(self, run: RetryRun, role: Role, candidates: tuple[Endpoint, ...]) -> Pick:
        chosen, rank = self._scheduler.pick(role, run.features, candidates)
        self.picked(run, chosen)
        return chosen, rank

    def picked(self, run: RetryRun, endpoint: Endpoint) -> None:
        """A request chose ``endpoint``: if half-open, this request's leg is its trial."""
        if self._outliers.on_pick(endpoint):
            if run.trials is None:
                run.trials = [endpoint]
            else:
                run.trials.append(endpoint)

    async def retry(
        self,
        run: RetryRun,
        role: Role,
        failed: Endpoint,
        error: UpstreamError,
        attempt: Callable[[Endpoint, int | None], Awaitable[T]],
    ) -> T:
        """The attempts after the one on ``failed`` failed with ``error``, each on another
        instance of ``role``; raises the last failure when it must not or cannot be retried."""
        while True:
            reason = retry_reason(error)
            if reason is None:
                raise error
            endpoint, rank = await self.replacement(run, role, failed, error, reason)
            logger.debug("%s %s failed (%s), retrying", role.value, failed.url, reason)
            try:
                return await attempt(endpoint, rank)
            except UpstreamError as exc:
                failed, error = endpoint, exc

    async def replacement(
        self, run: RetryRun, role: Role, failed: Endpoint, error: UpstreamError, reason: str
    ) -> Pick:
        """The instance of ``role`` to retry on in place of ``failed``, which failed with
        ``error`` for the retry-safe ``reason``; re-raises ``error`` when this request has no
        retry left, the budget is spent, or no instance is left."""
        if not self._may_retry(run, error.leg, reason):
            raise error
        tried = run.tried.get(role)
        if tried is None:
            run.tried[role] = {failed.url}
        else:
            tried.add(failed.url)
        run.last_failed[role] = failed.url
        try:
            return await self._another(run, role)
        except NoEndpointAvailable:
            raise error from None

    def _may_retry(self, run: RetryRun, leg: str, reason: str) -> bool:
        if run.retries_left <= 0:
            return False
        if not self._budget.try_spend():
            self._metrics.retry_budget_exhausted.labels(leg).inc()
            return False
        run.retries_left -= 1
        self._metrics.count_retry(leg, reason)
        return True

    async def _another(self, run: RetryRun, role: Role) -> Pick:
        """An instance of ``role`` this request has not tried yet, and its DP rank."""
        model = run.features.model
        candidates = self._outliers.usable(self._pool(role, model), run.tried[role])
        if not candidates:
            # Every instance of the role was tried: back off, then anyone but the last
            # to fail (or it, if it is the only one).
            await asyncio.sleep(self._backoff.delay(run.rounds, self._rng))
            run.rounds += 1
            run.tried[role].clear()
            pool = self._pool(role, model)
            usable = self._outliers.usable
            candidates = usable(pool, {run.last_failed[role]}) or usable(pool, ())
        return self.pick(run, role, candidates)
