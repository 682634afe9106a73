"""How fast each prefill is, and how big a prompt is, from the proxy's own measurements.

Every successful prefill leg gives its seconds and the prompt tokens the prefill actually
**computed** (its prompt less what it found cached, as the prefill reports it:
``computed_tokens``). A leg that hit the cache did less work, not faster work, and a short
prompt costs a fixed part (scheduling, the HTTP round trip) that its few tokens must not
be charged for. So each role keeps one exponentially weighted least-squares fit of its
legs, ``seconds = fixed + per_token * computed``, over all its instances, each leg's
seconds divided by its instance's slowness (the typical speed, which one slow instance's
legs do not tilt), and an instance's ``slowness`` is its legs' exponentially weighted mean of
``seconds / expected(computed)``: 1.0 until it was measured, 1.0 for an instance as fast
as its peers whatever the mix of its prompts and hits, 4.0 for one four times slower.
Loads are weighted by it (``Context.loads``), so an idle slow instance looks as busy as a
fast one with a few requests queued, and gets work only when that is the faster way; the
overload filter never drops an idle instance for its slowness alone (``OverloadFilter``),
so one that looked slow once is measured again.

A prefill leg counts as load by its size (``weight``): its estimated prompt over the
typical one, so a prefill busy with two long prompts is not mistaken for one with two
short ones.

A restarted instance (a new registry entry) starts at 1.0.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdproxy.types import Endpoint, Role
from pdproxy.wire.kv_params import KV_TRANSFER_PARAMS, REMOTE_PREFILL_CACHED_TOKENS

_ALPHA = 0.2  # weight of an instance's newest measurement
_FIT_ALPHA = 0.05  # weight of a role's newest leg in its fit (it sees every instance's)
_MIN_TOKENS = 16.0  # prompt sizes for ``weight``: tiny prompts count as this many
_MIN_WEIGHT, _MAX_WEIGHT = 0.1, 32.0
_MIN_SLOWNESS, _MAX_SLOWNESS = 0.1, 16.0  # one odd leg cannot blind the scheduler
_MIN_SPREAD = 1.0  # tokens²: below this variance of sizes, no per-token slope is fitted


def computed_tokens(
    estimated: float, answer: Mapping[str, Any], predicted_hit: float | None = None
) -> float:
    """The prompt tokens a prefill computed for ``answer``: its prompt (the answer's
    ``usage.prompt_tokens``, else ``estimated``) less what it found cached (vLLM's
    ``kv_transfer_params.remote_prefill_cached_tokens``, else the OpenAI
    ``usage.prompt_tokens_details.cached_tokens``, else the KV index's ``predicted_hit``).
    Anything odd in the answer counts as absent: a hostile prefill cannot make this
    negative or larger than its prompt."""
    usage = answer.get("usage")
    prompt: float | None = None
    hit: float | None = None
    if isinstance(usage, dict):
        prompt = _tokens(usage.get("prompt_tokens"))
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            hit = _tokens(details.get("cached_tokens"))
    params = answer.get(KV_TRANSFER_PARAMS)
    if isinstance(params, dict):
        reported = _tokens(params.get(REMOTE_PREFILL_CACHED_TOKENS))
        hit = hit if reported is None else reported
    if prompt is None:
        prompt = estimated
    if hit is None:
        hit = max(predicted_hit or 0.0, 0.0)
    return max(prompt - min(hit, prompt), 0.0)


def _tokens(value: object) -> float | None:
    """A token count from a peer's JSON, or None when it is not a plausible one."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 40:
        return float(value)
    return None


@dataclass(slots=True)
class _Fit:
    """Exponentially weighted least squares of seconds against computed tokens."""

    n: float = 0.0  # sum of weights
    x: float = 0.0  # weighted means
    y: float = 0.0
    xx: float = 0.0  # weighted second moments about the means
    xy: float = 0.0

    def add(self, tokens: float, seconds: float, alpha: float) -> None:
        if self.n == 0.0:
            self.n, self.x, self.y = 1.0, tokens, seconds
            return
        dx, dy = tokens - self.x, seconds - self.y
        self.x += alpha * dx
        self.y += alpha * dy
        self.xx = (1.0 - alpha) * (self.xx + alpha * dx * dx)
        self.xy = (1.0 - alpha) * (self.xy + alpha * dx * dy)
        self.n += 1.0

    def expected(self, tokens: float) -> float:
        """Seconds a typical instance takes to compute ``tokens``; 0.0 before any leg."""
        if self.n == 0.0:
            return 0.0
        if self.xx < _MIN_SPREAD:
            return self.y  # one size seen so far: its mean time
        slope = max(self.xy / self.xx, 0.0)
        fixed = max(self.y - slope * self.x, 0.0)
        return fixed + slope * tokens

    def predicts(self, tokens: float) -> bool:
        """Whether ``expected(tokens)`` is a measurement rather than a guess: the fit has
        seen sizes apart (a slope), or legs of about this size."""
        if self.n == 0.0:
            return False
        return self.xx >= _MIN_SPREAD or abs(tokens - self.x) <= 0.1 * max(self.x, 16.0)

    def per_token(self) -> float:
        if self.n == 0.0:
            return 0.0
        if self.xx < _MIN_SPREAD:
            return self.y / max(self.x, 1.0)
        return max(self.xy / self.xx, 0.0)


class SpeedTracker:
    """The prefills' speeds: each role's fit, the typical prompt, and each endpoint's
    ``Speed`` record (its one writer).

    One per process, owned by the ``Scheduler`` (``Scheduler.speeds``). Fed by one caller:
    the orchestrator, with each successful prefill leg (``observe``). Read by the
    orchestrator (``weight``: a prefill leg's load), ``proxying.deadlines``
    (``prefill_seconds``) and, through ``Speed.slowness``, by ``Context.loads`` and
    ``kv_cost``."""

    def __init__(self, alpha: float = _ALPHA) -> None:
        self._alpha = alpha
        self._fits: dict[Role, _Fit] = {}
        self._typical_tokens = 0.0  # the prefills' typical prompt, in estimated tokens

    def weight(self, tokens: float) -> float:
        """A prefill leg's size as load: its prompt over the typical one (1.0 until one was
        measured; bounded so one odd estimate cannot blind the scheduler)."""
        typical = self._typical_tokens
        if typical <= 0:
            return 1.0
        return min(_MAX_WEIGHT, max(_MIN_WEIGHT, max(tokens, _MIN_TOKENS) / typical))

    def observe(self, endpoint: Endpoint, seconds: float, prompt: float, computed: float) -> None:
        """A leg of ``endpoint`` took ``seconds`` for a ``prompt`` of which it computed
        ``computed`` tokens (``computed_tokens``)."""
        seconds = max(seconds, 0.0)
        computed = max(computed, 0.0)
        alpha = self._alpha
        size, typical_size = max(prompt, _MIN_TOKENS), self._typical_tokens
        self._typical_tokens = (
            size if typical_size <= 0 else typical_size + alpha * (size - typical_size)
        )
        fit = self._fits.setdefault(endpoint.role, _Fit())
        speed = endpoint.speed
        # before this leg joins the fit it is judged by
        expected = fit.expected(computed) if fit.predicts(computed) else 0.0
        # The fit is of a typical instance: each leg joins it at its instance's speed, so
        # a slow instance's legs (often of other sizes) do not tilt it.
        fit.add(computed, seconds / speed.slowness, _FIT_ALPHA)
        mine = speed.seconds_per_token
        per_token = seconds / max(computed, 1.0)
        speed.seconds_per_token = per_token if mine <= 0 else mine + alpha * (per_token - mine)
        if expected <= 0.0:
            return  # nothing yet to compare a leg of this size with
        ratio = min(max(seconds / expected, _MIN_SLOWNESS), _MAX_SLOWNESS)
        speed.slowness += alpha * (ratio - speed.slowness)

    def prefill_seconds(self, endpoint: Endpoint, tokens: float) -> float | None:
        """Seconds ``endpoint`` would take to answer a prefill leg of ``tokens`` computed
        tokens sent now: the fit of its role at ``tokens`` plus the tokens its legs in
        flight still have to compute (``LegCounts.queued_tokens``: they share its steps),
        times its slowness. None before any leg was measured; where the fit has seen one
        size only, a bound no linear cost through it exceeds (a prediction errs short, so a
        deadline is never refused on a guess)."""
        fit = self._fits.get(endpoint.role)
        if fit is None or fit.n == 0.0:
            return None
        total = tokens + endpoint.legs.queued_tokens
        if fit.predicts(total):
            seconds = fit.expected(total)
        else:  # one size seen, another asked: what no linear cost through it exceeds
            seconds = min(fit.y, fit.per_token() * total)
        return seconds * endpoint.speed.slowness

    def typical(self, role: Role) -> float:
        """The role's fitted seconds per computed token (0.0 before any leg)."""
        fit = self._fits.get(role)
        return 0.0 if fit is None else fit.per_token()
