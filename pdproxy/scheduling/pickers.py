"""Pickers: the final choice among scored candidates."""

from __future__ import annotations

import random
from collections.abc import Sequence

from pdproxy.scheduling import Picker
from pdproxy.scheduling.context import Context
from pdproxy.scheduling.hash_ring import HashRings
from pdproxy.scheduling.view import EndpointView


class MaxScorePicker:
    """The highest score; ties go to the least loaded of them (``by_load``), then at
    random, so equal instances share the work. With ``spread``, a request nobody scored
    (a prompt matching no cache) goes where ``spread`` says instead."""

    type_name = "max-score-picker"

    def __init__(
        self, rng: random.Random, *, by_load: bool = False, spread: SpreadNew | None = None
    ) -> None:
        self._rng = rng
        self._by_load = by_load
        self._spread = spread

    def pick(
        self, ctx: Context, endpoints: Sequence[EndpointView], scores: list[float]
    ) -> EndpointView:
        best = max(scores)
        ties = scores.count(best)
        if ties == 1:
            return endpoints[scores.index(best)]
        top = endpoints  # everyone ties (nobody scored): keep the sequence, and its loads
        if best <= 0.0 and ties == len(endpoints) and self._spread is not None:
            return self._spread.pick(ctx, endpoints)
        if ties < len(endpoints):
            top = [e for e, s in zip(endpoints, scores, strict=True) if s == best]
        if self._by_load:
            return least_loaded(ctx, top, self._rng)
        return self._rng.choice(top)


class SpreadNew:
    """Where a prompt no cache holds goes: among the instances within one request of the
    least loaded, the one that took a new prefix least recently (ties at random).

    Least-loaded alone thrashes at low load: every instance idles at its slowness, so
    each new prefix lands on the one instance measured fastest, which evicts the last
    one (the issue's 5 of 6 new tenants on one prefill). Filling in turn keeps each
    cache's share of the prefixes even, while a busier instance still gets none."""

    type_name = "spread-new"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._filled: dict[str, int] = {}  # url -> when it last took a new prefix
        self._clock = 0

    def pick(self, ctx: Context, endpoints: Sequence[EndpointView]) -> EndpointView:
        loads = ctx.loads(endpoints)
        ceiling = min(loads) + 1.0  # one more request at typical speed
        filled = self._filled
        tier = [e for e, load in zip(endpoints, loads, strict=True) if load < ceiling]
        oldest = min(filled.get(e.url, -1) for e in tier)
        chosen = self._rng.choice([e for e in tier if filled.get(e.url, -1) == oldest])
        self._clock += 1
        filled[chosen.url] = self._clock
        if len(filled) > 4 * len(endpoints) + 16:  # instances that left: forget them
            current = {e.url for e in endpoints}
            self._filled = {u: t for u, t in filled.items() if u in current}
        return chosen


class LeastLoadedPicker:
    """The fewest requests in flight (``Context.loads``); ties at random. It needs no
    scores: the load is the whole criterion."""

    type_name = "least-loaded-picker"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(
        self, ctx: Context, endpoints: Sequence[EndpointView], scores: list[float]
    ) -> EndpointView:
        return least_loaded(ctx, endpoints, self._rng)


def least_loaded(
    ctx: Context, endpoints: Sequence[EndpointView], rng: random.Random
) -> EndpointView:
    loads = ctx.loads(endpoints)
    lowest = min(loads)
    ties = loads.count(lowest)
    if ties == 1:
        return endpoints[loads.index(lowest)]
    if ties == len(loads):
        return rng.choice(endpoints)
    return rng.choice([e for e, load in zip(endpoints, loads, strict=True) if load == lowest])


class RoundRobinPicker:
    """Each candidate in turn, ignoring scores."""

    type_name = "round-robin-picker"

    def __init__(self) -> None:
        self._turn = 0

    def pick(
        self, ctx: Context, endpoints: Sequence[EndpointView], scores: list[float]
    ) -> EndpointView:
        self._turn += 1
        return endpoints[(self._turn - 1) % len(endpoints)]


class RandomPicker:
    type_name = "random-picker"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(
        self, ctx: Context, endpoints: Sequence[EndpointView], scores: list[float]
    ) -> EndpointView:
        return self._rng.choice(endpoints)


class PowerOfTwoPicker:
    """Two candidates at random, the less loaded of them (ties: the first drawn). It
    needs no scores: only the two drawn instances' loads are looked at."""

    type_name = "power-of-two-picker"

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(
        self, ctx: Context, endpoints: Sequence[EndpointView], scores: list[float]
    ) -> EndpointView:
        a, b = self._rng.sample(endpoints, 2)
        load_a, load_b = ctx.loads((a, b))
        return b if load_b < load_a else a


class ConsistentHashPicker:
    """The instance owning the request's session key on a hash ring of the candidates;
    without a key, ``fallback`` decides."""

    type_name = "consistent-hash-picker"

    def __init__(self, fallback: Picker) -> None:
        self._rings = HashRings()
        self._fallback = fallback

    def pick(
        self, ctx: Context, endpoints: Sequence[EndpointView], scores: list[float]
    ) -> EndpointView:
        key = ctx.features.session
        if key is None:
            return self._fallback.pick(ctx, endpoints, scores)
        return self._rings.owner(key, endpoints)
