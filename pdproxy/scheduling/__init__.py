"""Scheduling: pure policy choosing a prefill and a decode for each request.

The shape is llm-d's: per role, **filters** narrow the candidates, weighted **scorers**
rate them (each score in [0, 1]), a **picker** chooses; a **decider** says whether a
request is worth disaggregating at all. Plugins see immutable endpoints and a per-request
``Context``; they never await and never do I/O. Randomness comes from an injected
``random.Random``, time from the ``now`` in the context.

Policies are named combinations of plugins (``scheduling.policies.POLICIES``); the
``Scheduler`` (``scheduling.scheduler``) runs them for both roles.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pdproxy.scheduling.context import Context
from pdproxy.scheduling.view import EndpointView

__all__ = ["Context", "Decider", "Filter", "Picker", "Scorer"]


class Filter(Protocol):
    type_name: str

    def filter(self, ctx: Context, endpoints: Sequence[EndpointView]) -> Sequence[EndpointView]:
        """The endpoints worth considering; never empty when ``endpoints`` is not (a filter
        that would leave nothing returns its input: the engine's own answer is better than
        a 503)."""
        ...


class Scorer(Protocol):
    type_name: str

    def score(self, ctx: Context, endpoints: Sequence[EndpointView]) -> list[float]:
        """One score in [0, 1] per endpoint, higher is better."""
        ...


class Picker(Protocol):
    type_name: str

    def pick(
        self, ctx: Context, endpoints: Sequence[EndpointView], scores: list[float]
    ) -> EndpointView:
        """One of ``endpoints`` (never empty); ``scores`` is aligned with it."""
        ...


class Decider(Protocol):
    type_name: str

    def disaggregate(self, ctx: Context, cached_tokens: float) -> bool:
        """True: prefill then decode. False: the decode alone serves the request.
        ``cached_tokens`` is the best prefix-index hit on a prefill, in tokens."""
        ...
