"""Retry policy: which leg failures are retry-safe, the fleet-wide retry budget, backoff.

A leg is retried only while nothing has reached the client. What is retry-safe:

* ``connect``  the engine could not be reached (refused, reset or timed out while connecting)
* ``timeout``  a prefill past ``--prefill-timeout-secs``, a decode's headers past
  ``--decode-header-timeout-secs``, or an engine silent past ``--request-timeout-secs``
* ``reset``    the connection broke, or the answer was cut or unreadable
* ``5xx``      the engine answered a server error
* ``429``/``408``  the engine was overloaded or timed the request out itself

An engine's other 4xx is the client's problem and is never retried. ``counts_against``
says which reasons count toward ejecting the instance: an engine's 4xx (429 and 408
included) never does.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from pdproxy.errors import (
    ProxyError,
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamServerError,
    UpstreamStatusError,
    UpstreamTimeout,
)

_OVERLOAD_STATUSES = frozenset({408, 429})
_INSTANCE_FAULTS = frozenset({"connect", "timeout", "reset", "5xx"})


def retry_reason(error: ProxyError) -> str | None:
    """The retry reason label for a leg failure, or None when it must not be retried."""
    if isinstance(error, UpstreamStatusError):
        if error.engine_status >= 500:
            return "5xx"
        if error.engine_status in _OVERLOAD_STATUSES:
            return str(error.engine_status)
        return None
    if isinstance(error, UpstreamServerError):
        return "5xx"
    if isinstance(error, UpstreamConnectError):
        return "connect"
    if isinstance(error, UpstreamTimeout):
        return "timeout"
    if isinstance(error, UpstreamProtocolError):
        return "reset"
    return None


def counts_against(reason: str) -> bool:
    """True when a failure of this kind is the instance's fault (toward its ejection)."""
    return reason in _INSTANCE_FAULTS


class RetryBudget:
    """Retries may add at most ``ratio`` of the requests seen over ``window`` seconds, plus a
    floor of ``min_per_sec`` so a quiet proxy can still retry (Finagle's and Envoy's retry
    budgets). A fleet-wide outage therefore cannot multiply the load on the engines.

    Counts live in ``_BUCKETS`` time buckets, so memory and cost per request are constant.
    """

    _BUCKETS = 10

    def __init__(
        self,
        *,
        ratio: float,
        window: float,
        min_per_sec: float,
        clock: Callable[[], float],
    ) -> None:
        self._ratio = ratio
        self._width = window / self._BUCKETS
        self._floor = min_per_sec * window
        self._clock = clock
        self._slots = [-1] * self._BUCKETS  # which time bucket each slot holds
        self._requests = [0] * self._BUCKETS
        self._retries = [0] * self._BUCKETS

    def on_request(self) -> None:
        self._requests[self._slot()] += 1

    def try_spend(self) -> bool:
        """Take one retry from the budget; False when it is spent."""
        slot = self._slot()
        if sum(self._retries) >= self._ratio * sum(self._requests) + self._floor:
            return False
        self._retries[slot] += 1
        return True

    def _slot(self) -> int:
        bucket = int(self._clock() / self._width)
        slot = bucket % self._BUCKETS
        if self._slots[slot] != bucket:
            stale = [i for i, b in enumerate(self._slots) if b <= bucket - self._BUCKETS]
            for i in {slot, *stale}:
                self._slots[i], self._requests[i], self._retries[i] = bucket, 0, 0
        return slot


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with jitter, used only once every instance of a role was tried."""

    initial: float
    maximum: float
    multiplier: float
    jitter: float

    def delay(self, round_: int, rng: random.Random) -> float:
        """Seconds to wait before the ``round_``-th pass (0-based) over the same instances."""
        base = min(self.maximum, self.initial * self.multiplier**round_)
        return max(0.0, base * (1 + self.jitter * (2 * rng.random() - 1)))
