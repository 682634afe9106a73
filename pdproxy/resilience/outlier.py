"""Passive health: outlier ejection with a circuit breaker per instance (Envoy's model).

``consecutive_failures`` leg failures in a row that are the instance's fault eject it for
``base_ejection`` seconds, doubled on each re-ejection up to ``max_ejection``. When the
time is up the breaker is half-open: exactly one trial request is let through, and its
success closes the breaker (the instance is back, its ejection count reset) while its
failure ejects it again for twice as long. Limits keep ejection from emptying a role: the
last routable instance of a role is never ejected, nor more than ``max_ejection_percent``
of a role at once.

An instance that answers 429 (or 408) is not failing but overloaded: it is never ejected
for it, but for ``overload_cooldown`` seconds new requests go to its peers first, so a
shedding engine is not handed half the traffic only for most of it to be retried.

The state lives on each ``Endpoint`` (``endpoint.health``); the detector only applies the
rules, against an injected clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence

from pdproxy.config.resilience import OutlierConfig
from pdproxy.types import BreakerState, Endpoint


class OutlierDetector:
    def __init__(self, config: OutlierConfig, clock: Callable[[], float]) -> None:
        self._config = config
        self._clock = clock

    @property
    def enabled(self) -> bool:
        return self._config.consecutive_failures > 0

    def available(self, endpoint: Endpoint) -> bool:
        """May a new request go to ``endpoint``? A half-open one takes a single trial; an
        overloaded one waits out its cool-down (callers fall back to it if nothing else is
        left)."""
        health = endpoint.health
        if health.overloaded_until and self._clock() < health.overloaded_until:
            return False
        if health.ejected_until is None:
            return True
        return not health.trial_in_flight and self._clock() >= health.ejected_until

    def usable(
        self, pool: tuple[Endpoint, ...], avoid: Collection[str] = ()
    ) -> tuple[Endpoint, ...]:
        """``pool`` less the URLs in ``avoid`` and the unavailable; if only unavailable ones
        are left, those (an ejected instance is a better bet than a certain 503). Nothing
        dropped: ``pool`` itself, so the policies' per-snapshot caches hold."""
        allowed = tuple(e for e in pool if e.url not in avoid) if avoid else pool
        available = self.available
        if all(map(available, allowed)):
            return allowed
        return tuple(e for e in allowed if available(e)) or allowed

    def on_overloaded(self, endpoint: Endpoint) -> None:
        """It answered 429/408: peers first for a while. Never counts toward ejection."""
        endpoint.health.trial_in_flight = False
        if self._config.overload_cooldown > 0:
            endpoint.health.overloaded_until = self._clock() + self._config.overload_cooldown

    def on_pick(self, endpoint: Endpoint) -> bool:
        """A request chose ``endpoint``: if half-open, this is its one trial (True)."""
        health = endpoint.health
        if health.ejected_until is None:
            return False
        health.trial_in_flight = True
        return True

    def on_success(self, endpoint: Endpoint) -> None:
        health = endpoint.health
        health.consecutive_failures = 0
        if health.ejected_until is not None:
            self.reset(endpoint)

    def on_abandoned(self, endpoint: Endpoint) -> None:
        """The leg ended without a verdict (the client left): free a half-open trial."""
        endpoint.health.trial_in_flight = False

    def on_failure(self, endpoint: Endpoint, peers: Sequence[Endpoint]) -> bool:
        """Count a failure that is the instance's fault; True if it was ejected now.

        ``peers`` are the routable instances of its role, for the ejection limits.
        """
        health = endpoint.health
        health.consecutive_failures += 1
        if not self.enabled:
            return False
        if health.ejected_until is not None:
            if not health.trial_in_flight:
                return False  # a leg that started before the ejection; already counted
            health.trial_in_flight = False
            self._eject(endpoint)
            return True
        if health.consecutive_failures < self._config.consecutive_failures:
            return False
        if not self._may_eject(endpoint, peers):
            return False
        self._eject(endpoint)
        return True

    def end_ejection(self, endpoint: Endpoint) -> None:
        """Active health saw the instance die and come back: let its trial through now."""
        health = endpoint.health
        if health.ejected_until is not None and not health.trial_in_flight:
            health.ejected_until = min(health.ejected_until, self._clock())

    def _eject(self, endpoint: Endpoint) -> None:
        health = endpoint.health
        seconds = min(self._config.max_ejection, self._config.base_ejection * 2.0**health.ejections)
        health.ejections += 1
        health.ejections_total += 1
        health.ejected_until = self._clock() + seconds

    @staticmethod
    def reset(endpoint: Endpoint) -> None:
        """Back in rotation with a clean record (a trial succeeded, or active health saw it
        recover)."""
        health = endpoint.health
        health.ejected_until = None
        health.trial_in_flight = False
        health.ejections = 0
        health.consecutive_failures = 0

    def _may_eject(self, endpoint: Endpoint, peers: Sequence[Endpoint]) -> bool:
        others = [p for p in peers if p is not endpoint]
        ejected = sum(1 for p in others if p.health.ejected_until is not None)
        total = len(others) + 1
        cap = math.floor(total * self._config.max_ejection_percent / 100)
        return ejected + 1 <= cap and ejected + 1 < total

    def state(self, endpoint: Endpoint) -> BreakerState:
        health = endpoint.health
        if health.ejected_until is None:
            return BreakerState.CLOSED
        if health.trial_in_flight or self._clock() >= health.ejected_until:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN
