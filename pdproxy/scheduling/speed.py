"""How fast each prefill is, and how big a prompt is, from the proxy's own measurements.

Every successful prefill leg gives its seconds per estimated prompt token. An instance
keeps an exponentially weighted mean of them; its role keeps one over all its instances
(the typical speed). ``Endpoint.slowness`` is the instance's mean over the typical one:
1.0 until it was measured, 4.0 for a prefill four times slower than its peers. Loads are
weighted by it (``Context.loads``), so an idle slow instance looks as busy as a fast one
with a few requests queued, and gets work only when that is the faster way.

A prefill leg counts as load by its size (``weight``): its estimated prompt over the
typical one, so a prefill busy with two long prompts is not mistaken for one with two
short ones.

A slow instance that gets less traffic is measured less often; it is measured again as
soon as its peers are busy enough to send it work, and a restarted instance (a new
registry entry) starts at 1.0.
"""

from __future__ import annotations

from pdproxy.types import Endpoint, Role

_ALPHA = 0.2  # weight of the newest measurement
_MIN_TOKENS = 16.0  # tiny prompts are dominated by fixed costs: count them as this many
_MIN_WEIGHT, _MAX_WEIGHT = 0.1, 32.0


class SpeedTracker:
    def __init__(self, alpha: float = _ALPHA) -> None:
        self._alpha = alpha
        self._typical: dict[Role, float] = {}
        self._typical_tokens = 0.0  # the prefills' typical prompt, in estimated tokens

    def weight(self, tokens: float) -> float:
        """A prefill leg's size as load: its prompt over the typical one (1.0 until one was
        measured; bounded so one odd estimate cannot blind the scheduler)."""
        typical = self._typical_tokens
        if typical <= 0:
            return 1.0
        return min(_MAX_WEIGHT, max(_MIN_WEIGHT, max(tokens, _MIN_TOKENS) / typical))

    def observe(self, endpoint: Endpoint, seconds: float, tokens: float) -> None:
        """A leg of ``endpoint`` served ``tokens`` prompt tokens in ``seconds``."""
        per_token = max(seconds, 0.0) / max(tokens, _MIN_TOKENS)
        alpha = self._alpha
        size, typical_size = max(tokens, _MIN_TOKENS), self._typical_tokens
        self._typical_tokens = (
            size if typical_size <= 0 else typical_size + alpha * (size - typical_size)
        )
        mine = endpoint.speed.seconds_per_token
        endpoint.speed.seconds_per_token = (
            per_token if mine <= 0 else mine + alpha * (per_token - mine)
        )
        typical = self._typical.get(endpoint.role, 0.0)
        typical = per_token if typical <= 0 else typical + alpha * (per_token - typical)
        self._typical[endpoint.role] = typical
        if typical > 0:
            endpoint.speed.slowness = endpoint.speed.seconds_per_token / typical

    def typical(self, role: Role) -> float:
        return self._typical.get(role, 0.0)
