"""Policies: named combinations of filters, weighted scorers and a picker, per role.

==================  ===============================================================
round-robin         each instance in turn
random              uniformly at random
least-loaded        fewest requests in flight (proxy legs, or the engine's queue)
power-of-two        two at random, the less loaded
consistent-hash     the session key's owner on a hash ring; least-loaded without a key
prefix-affinity     the instance holding the longest prefix of the prompt, among those
                    not overloaded; least-loaded on a tie; a prompt matching nowhere to
                    the least recently filled of the least loaded (vllm-router's
                    cache_aware)
kv-aware            most free KV cache and fewest requests (the engines' /metrics)
kv-events           prefix-affinity scored by the exact cached prefix each engine
                    reports in its KV events (``kv_scorer``), where they are followed;
                    on the prefill leg, the hit against the queue in tokens of work
                    (``kv_cost``); on the decode leg, the blocks held (the overload
                    filter and the load tie-break weigh them against load)
==================  ===============================================================
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.scheduling import Filter, Picker, Scorer
from pdproxy.scheduling.context import Context
from pdproxy.scheduling.filters import ModelFilter, OverloadFilter
from pdproxy.scheduling.kv_cost import PrefillCostScorer
from pdproxy.scheduling.kv_events import KVIndex
from pdproxy.scheduling.kv_scorer import KVEventsScorer
from pdproxy.scheduling.pickers import (
    ConsistentHashPicker,
    LeastLoadedPicker,
    MaxScorePicker,
    PowerOfTwoPicker,
    RandomPicker,
    RoundRobinPicker,
    SpreadNew,
)
from pdproxy.scheduling.prefix_index import PrefixIndex
from pdproxy.scheduling.scorers import KVUsageScorer, LoadScorer, PrefixScorer
from pdproxy.scheduling.view import EndpointView
from pdproxy.types import Role


@dataclass(frozen=True, slots=True)
class RolePolicy:
    """One role's pipeline: filters → weighted scores → pick. ``index``, when set, learns
    every choice (the prompt's prefix is now on the chosen instance)."""

    name: str
    filters: tuple[Filter, ...]
    scorers: tuple[tuple[Scorer, float], ...]
    picker: Picker
    index: PrefixIndex | None = None

    def choose(self, ctx: Context, endpoints: Sequence[EndpointView]) -> EndpointView:
        candidates = endpoints
        for step in self.filters:
            candidates = step.filter(ctx, candidates)
        if len(candidates) == 1:
            chosen = candidates[0]
        else:
            chosen = self.picker.pick(ctx, candidates, self._scores(ctx, candidates))
        if self.index is not None and ctx.features.blocks:
            self.index.insert(ctx.features.blocks, chosen.url)
        return chosen

    def _scores(self, ctx: Context, candidates: Sequence[EndpointView]) -> list[float]:
        if not self.scorers:
            return []
        if len(self.scorers) == 1:
            return self.scorers[0][0].score(ctx, candidates)
        (first, w1), *rest = self.scorers
        total = [w1 * v for v in first.score(ctx, candidates)]
        for scorer, weight in rest:
            total = [
                t + weight * v for t, v in zip(total, scorer.score(ctx, candidates), strict=True)
            ]
        return total


_Factory = Callable[[SchedulingConfig, random.Random, KVIndex, Role], RolePolicy]


def _round_robin(
    config: SchedulingConfig, rng: random.Random, kv: KVIndex, role: Role
) -> RolePolicy:
    return RolePolicy("round-robin", (ModelFilter(),), (), RoundRobinPicker())


def _random(config: SchedulingConfig, rng: random.Random, kv: KVIndex, role: Role) -> RolePolicy:
    return RolePolicy("random", (ModelFilter(),), (), RandomPicker(rng))


def _least_loaded(
    config: SchedulingConfig, rng: random.Random, kv: KVIndex, role: Role
) -> RolePolicy:
    return RolePolicy("least-loaded", (ModelFilter(),), (), LeastLoadedPicker(rng))


def _power_of_two(
    config: SchedulingConfig, rng: random.Random, kv: KVIndex, role: Role
) -> RolePolicy:
    return RolePolicy("power-of-two", (ModelFilter(),), (), PowerOfTwoPicker(rng))


def _consistent_hash(
    config: SchedulingConfig, rng: random.Random, kv: KVIndex, role: Role
) -> RolePolicy:
    picker = ConsistentHashPicker(LeastLoadedPicker(rng))
    return RolePolicy("consistent-hash", (ModelFilter(),), (), picker)


def _prefix_affinity(
    config: SchedulingConfig, rng: random.Random, kv: KVIndex, role: Role
) -> RolePolicy:
    index = PrefixIndex(config.prefix_index_max_blocks)
    overload = OverloadFilter(config.balance_abs_threshold, config.balance_rel_threshold)
    # The longest match wins; the load breaks ties between equal matches, and a prompt
    # that matches nowhere fills the caches in turn (``SpreadNew``).
    picker = MaxScorePicker(rng, by_load=True, spread=SpreadNew(rng))
    scorers = ((PrefixScorer(index, config.cache_threshold), 1.0),)
    return RolePolicy("prefix-affinity", (ModelFilter(), overload), scorers, picker, index)


def _kv_events(config: SchedulingConfig, rng: random.Random, kv: KVIndex, role: Role) -> RolePolicy:
    index = PrefixIndex(config.prefix_index_max_blocks)  # for instances without events
    overload = OverloadFilter(config.balance_abs_threshold, config.balance_rel_threshold)
    picker = MaxScorePicker(rng, by_load=True, spread=SpreadNew(rng))
    exact = KVEventsScorer(kv, PrefixScorer(index, config.cache_threshold), config.cache_threshold)
    scorer: Scorer = (
        PrefillCostScorer(exact, config.kv_queue_weight) if role is Role.PREFILL else exact
    )
    return RolePolicy("kv-events", (ModelFilter(), overload), ((scorer, 1.0),), picker, index)


def _kv_aware(config: SchedulingConfig, rng: random.Random, kv: KVIndex, role: Role) -> RolePolicy:
    scorers = ((KVUsageScorer(), 1.0), (LoadScorer(), 1.0))
    return RolePolicy("kv-aware", (ModelFilter(),), scorers, MaxScorePicker(rng))


POLICY_FACTORIES: dict[str, _Factory] = {
    "round-robin": _round_robin,
    "random": _random,
    "least-loaded": _least_loaded,
    "power-of-two": _power_of_two,
    "consistent-hash": _consistent_hash,
    "prefix-affinity": _prefix_affinity,
    "kv-aware": _kv_aware,
    "kv-events": _kv_events,
}


def build_policy(
    name: str,
    config: SchedulingConfig,
    rng: random.Random,
    kv: KVIndex | None = None,
    role: Role = Role.DECODE,
) -> RolePolicy:
    """The policy ``name`` (already canonical: ``config.SchedulingConfig`` checks it) for
    ``role``'s leg; ``kv`` is the fleet's KV-event index (``kv-events`` reads it; a fresh
    one if None)."""
    index = kv if kv is not None else KVIndex(config.prefix_index_max_blocks)
    return POLICY_FACTORIES[name](config, rng, index, role)
