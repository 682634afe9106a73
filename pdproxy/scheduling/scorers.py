"""Scorers: each rates every candidate in [0, 1], higher is better."""

from __future__ import annotations

from collections.abc import Sequence

from pdproxy.scheduling.context import Context
from pdproxy.scheduling.prefix_index import PrefixIndex
from pdproxy.scheduling.view import EndpointView


class LoadScorer:
    """A lighter load is better: ``1 / load`` (``Context.load`` counts the new request,
    so it is at least the instance's slowness, 1 for a typical idle one)."""

    type_name = "load-scorer"

    def score(self, ctx: Context, endpoints: Sequence[EndpointView]) -> list[float]:
        return [1.0 / load if load > 1.0 else 1.0 for load in ctx.loads(endpoints)]


class KVUsageScorer:
    """More free KV cache is better: ``1 - kv_cache_usage_perc`` from the engine's last
    fresh scrape; an instance with no fresh figure scores 0.5 (neither preferred nor
    avoided)."""

    type_name = "kv-usage-scorer"

    def score(self, ctx: Context, endpoints: Sequence[EndpointView]) -> list[float]:
        oldest = ctx.now - ctx.max_age
        # engine_stats keeps kv_usage in [0, 1], so the score is too.
        return [
            0.5 if (f := e.load.engine_load) is None or f.scraped_at < oldest else 1.0 - f.kv_usage
            for e in endpoints
        ]


class PrefixScorer:
    """The share of the prompt's blocks an instance holds as a leading prefix; a share
    under ``min_share`` counts as none (SMG's ``cache_threshold``): a new conversation
    that only shares a short system prompt is placed by load, so conversations spread
    over the fleet instead of piling onto whichever instance saw that system prompt first."""

    type_name = "prefix-scorer"

    def __init__(self, index: PrefixIndex, min_share: float = 0.0) -> None:
        self.index = index
        self.min_share = min_share
        self._positions: tuple[Sequence[EndpointView] | None, dict[str, int] | None] = (None, None)

    def score(self, ctx: Context, endpoints: Sequence[EndpointView]) -> list[float]:
        scores = [0.0] * len(endpoints)
        total = len(ctx.features.blocks)
        depths = prefix_matches(ctx, self.index) if total else None
        if not depths:
            return scores
        floor = self.min_share * total
        positions = self._positions_of(endpoints)
        if positions is not None:  # a snapshot seen before: visit only the matches
            for url, depth in depths.items():
                at = positions.get(url)
                if at is not None and depth >= floor:
                    scores[at] = depth / total
            return scores
        for at, endpoint in enumerate(endpoints):
            depth = depths.get(endpoint.address.url, 0)
            if depth and depth >= floor:
                scores[at] = depth / total
        return scores

    def _positions_of(self, endpoints: Sequence[EndpointView]) -> dict[str, int] | None:
        """url -> index for a sequence met twice in a row (the registry's snapshot, which
        lasts until membership or health changes); None for one met once (a filter's
        survivors), which is cheaper to scan than to index."""
        last, positions = self._positions
        if endpoints is not last:
            self._positions = (endpoints, None)
            return None
        if positions is None:
            positions = {e.address.url: i for i, e in enumerate(endpoints)}
            self._positions = (endpoints, positions)
        return positions


def prefix_matches(ctx: Context, index: PrefixIndex) -> dict[str, int]:
    """``index.match`` of the request's blocks, computed once per decision."""
    key = id(index)
    depths = ctx.matches.get(key)
    if depths is None:
        depths = ctx.matches[key] = index.match(ctx.features.blocks)
    return depths
