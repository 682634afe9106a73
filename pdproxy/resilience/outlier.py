"""The health book: the one writer of each instance's ``EndpointHealth``, applying both
its rule books; the probe tasks (``membership.health``, or under ``--workers`` the owner's
published verdicts, ``membership.workers.link``) and the request path's verdicts
(``proxying.verdicts``) only report to it. ``tests/unit/test_record_owners.py`` holds it to that.

Active health (vllm-router's thresholds): an instance that has never answered is
``UNKNOWN`` and not routable; its first answer makes it healthy. A healthy one turns
unhealthy after ``failure_threshold`` failed probes in a row, and healthy again after
``success_threshold`` successes in a row. Where the two meet: an instance whose probes failed
while it was ejected and that answers again has come back (a restart), so its trial request
is let through at once; one that recovers from unhealthy starts with a clean record. A
restart or a changed verdict means the engine's KV connections are gone: the listeners of
``on_connections_lost`` hear it (the legs forget the KV sources it read from), as they do
of an ejection.

Passive health: outlier ejection with a circuit breaker per instance (Envoy's model).

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

A push decode left waiting for KV that will not come (``--kv-connector nixl-push``) leaks
its blocks in vLLM 0.32: it is stranded, out of rotation until a load scrape taken after it
shows its KV usage at 0, or ``STRANDED_MAX`` seconds at most (the leak may never clear
without a restart, and a decode out for good would be a worse outcome than its leaked blocks).

The state lives on each ``Endpoint`` (``endpoint.health``); the book applies the rules
against an injected clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence

from pdproxy.config.resilience import HealthConfig, OutlierConfig
from pdproxy.types import BreakerState, Endpoint, EndpointHealth, ProbeState

STRANDED_MAX = 300.0  # seconds a stranded decode stays out at most


class OutlierDetector:
    """The health book (see the module's docstring)."""

    def __init__(self, config: OutlierConfig, clock: Callable[[], float]) -> None:
        self._config = config
        self._clock = clock
        self._lost: list[Callable[[Endpoint], None]] = []

    def on_connections_lost(self, listener: Callable[[Endpoint], None]) -> None:
        """Call ``listener(endpoint)`` whenever the engine's KV connections are gone: a
        restart, a changed probe verdict, an ejection."""
        self._lost.append(listener)

    # -- active health: the probes' verdicts ------------------------------------------

    def probing(self, endpoint: Endpoint) -> None:
        """A new instance: not routable until its first probe answers."""
        endpoint.health.probe = ProbeState.UNKNOWN

    def on_probe(self, endpoint: Endpoint, ok: bool, config: HealthConfig) -> ProbeState | None:
        """One probe result of this process's health checks; the new verdict when it
        changed, else None."""
        self._probed_while_ejected(endpoint, failed=not ok, answers=ok)
        before = endpoint.health.probe
        after = apply_probe(endpoint.health, ok, config)
        if after is not None:
            self._verdict_changed(endpoint, before)
        return after

    def on_published_probe(self, endpoint: Endpoint, probe: ProbeState, failures: int) -> bool:
        """The verdict and run of failed probes the membership owner published (a worker
        follows it: ``--workers``), under the same rules; True when the verdict changed."""
        self._probed_while_ejected(
            endpoint, failed=failures > 0, answers=probe is ProbeState.HEALTHY
        )
        before = endpoint.health.probe
        if probe is before:
            return False
        self._verdict_changed(endpoint, before)
        endpoint.health.probe = probe
        return True

    def _probed_while_ejected(self, endpoint: Endpoint, *, failed: bool, answers: bool) -> None:
        health = endpoint.health
        if health.ejected_until is None:
            return
        if failed:
            health.probe_failed_while_ejected = True
        elif answers and health.probe_failed_while_ejected:
            health.probe_failed_while_ejected = False  # a restart: a new engine
            self._connections_lost(endpoint)
            self.end_ejection(endpoint)

    def _verdict_changed(self, endpoint: Endpoint, before: ProbeState) -> None:
        if before is ProbeState.UNHEALTHY:
            self.reset(endpoint)
        self._connections_lost(endpoint)  # down, or back after being down

    def _connections_lost(self, endpoint: Endpoint) -> None:
        for listener in self._lost:
            listener(endpoint)

    # -- passive health: the legs' verdicts -------------------------------------------

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
        if health.stranded_at is not None and self.stranded(endpoint):
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

    def stranded(self, endpoint: Endpoint) -> bool:
        """Is ``endpoint`` a decode whose KV may still hold a stranded push's blocks?"""
        at = endpoint.health.stranded_at
        if at is None:
            return False
        load = endpoint.load.engine_load
        if load is not None and load.scraped_at > at and load.kv_usage == 0:
            return False
        return self._clock() < at + STRANDED_MAX

    def on_stranded(self, endpoint: Endpoint) -> None:
        """A push decode leg of ``endpoint`` was closed while it waited for its KV."""
        endpoint.health.stranded_at = self._clock()

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
        health.failures_before_success = health.consecutive_failures
        health.consecutive_failures = 0
        if health.ejected_until is not None:
            self.reset(endpoint)

    def on_untrusted(self, endpoint: Endpoint, peers: Sequence[Endpoint]) -> bool:
        """A leg recorded as a success answered what cannot be trusted (a prefill listing
        too few KV blocks): a failure after all, and the row its success reset goes on
        (else an instance that answers so every time was never ejected)."""
        health = endpoint.health
        health.consecutive_failures += health.failures_before_success
        health.failures_before_success = 0
        return self.on_failure(endpoint, peers)

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
        self._connections_lost(endpoint)  # it may be restarting: its KV connections with it

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
