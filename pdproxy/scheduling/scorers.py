"""Scorers: each rates every candidate in [0, 1], higher is better."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdproxy.scheduling.context import Context
from pdproxy.scheduling.prefix_index import PrefixIndex
from pdproxy.types import Endpoint


class LoadScorer:
    """A lighter load is better: ``1 / load`` (``Context.load`` counts the new request,
    so it is at least the instance's slowness, 1 for a typical idle one)."""

    type_name = "load-scorer"

    def score(self, ctx: Context, endpoints: Sequence[Endpoint]) -> list[float]:
        return [1.0 / max(load, 1.0) for load in ctx.loads(endpoints)]


class KVUsageScorer:
    """More free KV cache is better: ``1 - kv_cache_usage_perc`` from the engine's last
    fresh scrape; an instance with no fresh figure scores 0.5 (neither preferred nor
    avoided)."""

    type_name = "kv-usage-scorer"

    def score(self, ctx: Context, endpoints: Sequence[Endpoint]) -> list[float]:
        oldest = ctx.now - ctx.max_age
        return [
            0.5
            if (f := e.engine_load) is None or f.scraped_at < oldest
            else min(1.0, max(0.0, 1.0 - f.kv_usage))
            for e in endpoints
        ]


@dataclass(frozen=True, slots=True)
class PrefixScorer:
    """The share of the prompt's blocks an instance holds as a leading prefix; a share
    under ``min_share`` counts as none (SMG's ``cache_threshold``): a new conversation
    that only shares a short system prompt is placed by load, so conversations spread
    over the fleet instead of piling onto whichever instance saw that system prompt first."""

    index: PrefixIndex
    min_share: float = 0.0
    type_name = "prefix-scorer"

    def score(self, ctx: Context, endpoints: Sequence[Endpoint]) -> list[float]:
        total = len(ctx.features.blocks)
        if not total:
            return [0.0] * len(endpoints)
        depths = prefix_matches(ctx, self.index)
        if not depths:
            return [0.0] * len(endpoints)
        scale = 1.0 / total
        floor = self.min_share
        get = depths.get
        return [s if (s := get(e.address.url, 0) * scale) >= floor else 0.0 for e in endpoints]


def prefix_matches(ctx: Context, index: PrefixIndex) -> dict[str, int]:
    """``index.match`` of the request's blocks, computed once per decision."""
    key = id(index)
    depths = ctx.matches.get(key)
    if depths is None:
        depths = ctx.matches[key] = index.match(ctx.features.blocks)
    return depths
