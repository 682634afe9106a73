"""Filters: which candidates are worth scoring. (Routability, health and ejection are
the first filters; the orchestrator applies them to the registry's snapshot before a
policy runs, since a retry must also avoid the instances it already tried.)"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdproxy.scheduling.context import Context
from pdproxy.scheduling.view import EndpointView


class ModelFilter:
    """Instances known to serve the request's model (or not yet known to serve any).

    When none does, all stay: the engine's own 404 is the right answer, not a 503."""

    type_name = "model-filter"
    _MAX_REMEMBERED = 1024

    def __init__(self) -> None:
        # model -> the last candidates that all served it (the orchestrator's per-model
        # pools do: one identity check per decision, whichever models alternate)
        self._all_serve: dict[str, Sequence[EndpointView]] = {}

    def filter(self, ctx: Context, endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
        model = ctx.features.model
        if model is None:
            return endpoints
        if self._all_serve.get(model) is endpoints:
            return endpoints
        if all(not e.models or model in e.models for e in endpoints):
            if len(self._all_serve) >= self._MAX_REMEMBERED:
                self._all_serve.clear()
            self._all_serve[model] = endpoints
            return endpoints
        kept = [e for e in endpoints if not e.models or model in e.models]
        return kept or endpoints


@dataclass(frozen=True, slots=True)
class OverloadFilter:
    """Drops instances far busier than the least busy one: more than ``abs_threshold``
    requests above it *and* more than ``rel_threshold`` times it (SMG's
    ``balance_abs_threshold`` / ``balance_rel_threshold``). Cache affinity then chooses
    only among instances that can take the work.

    An idle instance (no legs of this proxy's, none of others' in its fresh scrape) is
    never dropped: its load is only its measured slowness, and a prefill dropped for a
    past slowness on a quiet fleet would never get the leg that measures it again."""

    abs_threshold: float
    rel_threshold: float
    type_name = "overload-filter"

    def filter(self, ctx: Context, endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
        if len(endpoints) < 2:
            return endpoints
        loads = ctx.loads(endpoints)
        floor = min(loads)
        limit = max(floor + self.abs_threshold, floor * self.rel_threshold)
        if max(loads) <= limit:
            return endpoints
        now = ctx.now
        kept = [i for i, load in enumerate(loads) if load <= limit or _idle(endpoints[i], now)]
        if len(kept) == len(endpoints):
            return endpoints
        survivors = [endpoints[i] for i in kept]
        ctx.remember_loads(survivors, [loads[i] for i in kept])  # the next plugins need them
        return survivors


def _idle(endpoint: EndpointView, now: float) -> bool:
    figures = endpoint.load
    return endpoint.legs.work <= 0.0 and (figures.others <= 0.0 or figures.others_until < now)
