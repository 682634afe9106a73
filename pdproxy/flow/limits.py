"""Each tenant within its limits: requests and tokens per minute, requests at once.

Per minute limits are token buckets that hold a minute's allowance and refill
continuously (a tenant may burst its whole minute, then goes at the limit's pace). A
request is charged on admission: one request, and its prompt tokens plus the tokens it
asks for (``max_tokens``; vLLM's default when it gives none), as OpenAI's own limiter
counts a request's ``max_tokens`` when it arrives. Past a limit the request is refused
with the figures OpenAI clients read (``x-ratelimit-*``, ``retry-after``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from pdproxy.config.tenants import TenantSpec
from pdproxy.flow.shared import Figures, LimitsFile
from pdproxy.flow.ticket import Ticket


@dataclass(slots=True)
class _Bucket:
    limit: float  # per minute
    level: float
    at: float

    def refill(self, now: float) -> None:
        self.level = min(self.limit, self.level + (now - self.at) * self.limit / 60.0)
        self.at = now

    def seconds_until(self, amount: float) -> float:
        """Until ``amount`` fits (the whole minute when it never can)."""
        short = min(amount, self.limit) - self.level
        return max(short, 0.0) * 60.0 / self.limit

    def reset_seconds(self) -> float:
        """Until the bucket is full again (OpenAI's ``x-ratelimit-reset-*``)."""
        return max(self.limit - self.level, 0.0) * 60.0 / self.limit


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a tenant's request is refused, and the figures for its headers."""

    reason: str  # "rate_limit" | "tenant_concurrency"
    message: str
    retry_after: int  # seconds
    headers: tuple[tuple[str, str], ...]  # x-ratelimit-*


@dataclass(slots=True)
class _TenantState:
    spec: TenantSpec
    requests: _Bucket | None
    tokens: _Bucket | None
    in_flight: int = 0  # every worker's, under --workers
    own: int = 0  # this process's


class TenantLimits:
    """The limit state of each tenant (only tenants with limits; the names come from the
    tenants file or are the default tenant's, so the set is bounded)."""

    def __init__(self, clock: Callable[[], float], shared: LimitsFile | None = None) -> None:
        self._clock = clock
        self._tenants: dict[str, _TenantState] = {}
        # --workers: every worker's buckets and in-flight counts, in one file
        self._shared = shared

    def share(self, shared: LimitsFile) -> None:
        """From now on the limits hold across every process sharing ``shared``."""
        self._shared = shared

    def admit(self, ticket: Ticket) -> Refusal | None:
        """Charge ``ticket`` to its tenant, or say why not (nothing charged then)."""
        spec = ticket.spec
        if not spec.limited:
            return None
        shared = self._shared
        if shared is None:
            return self._admit(ticket, self._state(ticket.tenant, spec))
        with shared.locked():
            state = self._state(ticket.tenant, spec)
            self._pull(shared, ticket.tenant, state)
            refusal = self._admit(ticket, state)
            self._push(shared, ticket.tenant, state)
            return refusal

    def _admit(self, ticket: Ticket, state: _TenantState) -> Refusal | None:
        spec = ticket.spec
        now = self._clock()
        for bucket in (state.requests, state.tokens):
            if bucket is not None:
                bucket.refill(now)
        if spec.max_concurrent and state.in_flight >= spec.max_concurrent:
            return self._refusal(
                state,
                "tenant_concurrency",
                f"tenant {ticket.tenant!r} has {spec.max_concurrent} requests in flight, its limit",
                1.0,
            )
        waits = []
        if state.requests is not None and state.requests.level < 1.0:
            waits.append(("requests", state.requests.seconds_until(1.0)))
        cost = ticket.cost
        if state.tokens is not None and state.tokens.level < min(cost, state.tokens.limit):
            waits.append(("tokens", state.tokens.seconds_until(cost)))
        if waits:
            what, wait = max(waits, key=lambda w: w[1])
            return self._refusal(
                state,
                "rate_limit",
                f"rate limit reached for tenant {ticket.tenant!r} on {what} per minute",
                wait,
            )
        if state.requests is not None:
            state.requests.level -= 1.0
        if state.tokens is not None:
            state.tokens.level -= min(cost, state.tokens.limit)
        state.in_flight += 1
        state.own += 1
        return None

    def release(self, ticket: Ticket) -> None:
        """``ticket``'s request (admitted by ``admit``) ended."""
        if not ticket.spec.limited:
            return
        state = self._tenants.get(ticket.tenant)
        if state is None or state.own <= 0:
            return
        shared = self._shared
        if shared is None:
            state.in_flight -= 1
            state.own -= 1
            return
        with shared.locked():
            self._pull(shared, ticket.tenant, state)
            state.in_flight = max(state.in_flight - 1, 0)
            state.own -= 1
            self._push(shared, ticket.tenant, state)

    @staticmethod
    def _pull(shared: LimitsFile, tenant: str, state: _TenantState) -> None:
        """``state`` as every worker left it; a bucket whose limit another worker's file
        changed keeps what was used of it (as ``reconfigure`` does)."""
        figures = shared.read(tenant)
        if figures is None:
            return
        for bucket, limit, level, at in (
            (state.requests, figures.rpm, figures.rpm_level, figures.rpm_at),
            (state.tokens, figures.tpm, figures.tpm_level, figures.tpm_at),
        ):
            if bucket is None or limit <= 0:
                continue
            bucket.at = at
            bucket.level = level if limit == bucket.limit else bucket.limit - (limit - level)
        state.in_flight = figures.in_flight

    @staticmethod
    def _push(shared: LimitsFile, tenant: str, state: _TenantState) -> None:
        r, t = state.requests, state.tokens
        figures = Figures(
            r.limit if r else 0.0,
            r.level if r else 0.0,
            r.at if r else 0.0,
            t.limit if t else 0.0,
            t.level if t else 0.0,
            t.at if t else 0.0,
        )
        shared.write(tenant, figures, state.own)

    def headers(self, ticket: Ticket) -> tuple[tuple[str, str], ...]:
        """The ``x-ratelimit-*`` headers of ``ticket``'s tenant now."""
        state = self._tenants.get(ticket.tenant)
        return () if state is None else _headers(state)

    def reconfigure(self, specs: dict[str, TenantSpec]) -> None:
        """A reloaded tenants file: each tenant keeps what it used of its minute."""
        for name, state in list(self._tenants.items()):
            spec = specs.get(name)
            if spec is None or not spec.limited:
                if state.own == 0:
                    del self._tenants[name]
                continue
            fresh = _new_state(spec, self._clock())
            for old, new in ((state.requests, fresh.requests), (state.tokens, fresh.tokens)):
                if old is not None and new is not None:
                    old.refill(new.at)
                    new.level = new.limit - (old.limit - old.level)  # what it used stays used
            fresh.in_flight, fresh.own = state.in_flight, state.own
            self._tenants[name] = fresh

    def _state(self, tenant: str, spec: TenantSpec) -> _TenantState:
        state = self._tenants.get(tenant)
        if state is None or state.spec != spec:
            fresh = _new_state(spec, self._clock())
            if state is not None:
                fresh.in_flight, fresh.own = state.in_flight, state.own
            state = self._tenants[tenant] = fresh
        return state

    def _refusal(self, state: _TenantState, reason: str, message: str, wait: float) -> Refusal:
        return Refusal(reason, message, max(1, math.ceil(wait)), _headers(state))


def _new_state(spec: TenantSpec, now: float) -> _TenantState:
    rpm, tpm = spec.requests_per_minute, spec.tokens_per_minute
    return _TenantState(
        spec,
        _Bucket(float(rpm), float(rpm), now) if rpm else None,
        _Bucket(float(tpm), float(tpm), now) if tpm else None,
    )


def _headers(state: _TenantState) -> tuple[tuple[str, str], ...]:
    out: list[tuple[str, str]] = []
    for what, bucket in (("requests", state.requests), ("tokens", state.tokens)):
        if bucket is None:
            continue
        out += [
            (f"x-ratelimit-limit-{what}", str(int(bucket.limit))),
            (f"x-ratelimit-remaining-{what}", str(max(int(bucket.level), 0))),
            (f"x-ratelimit-reset-{what}", duration(bucket.reset_seconds())),
        ]
    return tuple(out)


def duration(seconds: float) -> str:
    """OpenAI's spelling of a reset time: ``6m0s``, ``1.5s``, ``20ms``."""
    if seconds < 1.0:
        return f"{max(int(seconds * 1000), 0)}ms"
    minutes, rest = divmod(seconds, 60.0)
    text = f"{rest:.3g}s" if rest != int(rest) else f"{int(rest)}s"
    return f"{int(minutes)}m{text}" if minutes else text
