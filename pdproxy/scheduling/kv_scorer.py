"""The exact prefix scorer: each instance's cached prefix of the prompt, from its engine's
KV events (``scheduling.kv_events``), where they are followed; else the approximate one.

An instance's predicted hit is vLLM's: its longest run of leading blocks of the prompt's
token ids, on its best data-parallel rank, never the whole prompt (vLLM recomputes at
least the last token: at most ``(n - 1) // block_size`` blocks). The same scorer serves
both legs: on a prefill the hit is prefill compute saved, on a decode blocks its connector
does not load.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdproxy.scheduling.context import Context
from pdproxy.scheduling.kv_events import KVIndex, block_keys, instance_name
from pdproxy.scheduling.scorers import PrefixScorer
from pdproxy.scheduling.view import EndpointView


class KVEventsScorer:
    """The share of the prompt an instance holds, exactly; an instance whose events are
    not followed (or stale) is scored by ``fallback``; a share under ``min_share`` counts
    as none, as in ``PrefixScorer``."""

    type_name = "kv-events-scorer"

    def __init__(self, index: KVIndex, fallback: PrefixScorer, min_share: float = 0.0) -> None:
        self.index = index
        self.fallback = fallback
        self.min_share = min_share

    def score(self, ctx: Context, endpoints: Sequence[EndpointView]) -> list[float]:
        ids = ctx.features.token_ids
        live = self.index.live
        if ids is None or not live or self.index.block_size < 1:
            return self.fallback.score(ctx, endpoints)
        approximate: list[float] | None = None
        scores = []
        floor = self.min_share * len(ids)
        for at, endpoint in enumerate(endpoints):
            cached = predicted_tokens(ctx, self.index, endpoint)
            if cached is None:
                if approximate is None:
                    approximate = self.fallback.score(ctx, endpoints)
                scores.append(approximate[at])
            else:
                scores.append(cached / len(ids) if cached and cached >= floor else 0.0)
        return scores


def predicted_tokens(ctx: Context, index: KVIndex, endpoint: EndpointView) -> int | None:
    """The prompt tokens ``endpoint``'s engine will find cached, from its events; None
    when its events are not followed or the request carries no token ids."""
    ids = ctx.features.token_ids
    size = index.block_size
    names = [instance_name(endpoint.url, rank) for rank in range(max(endpoint.dp_size, 1))]
    if ids is None or size < 1 or not any(name in index.live for name in names):
        return None
    depths = ctx.matches.get(id(index))
    if depths is None:
        keys = block_keys(ids, size, cache_salt=ctx.features.cache_salt)
        depths = ctx.matches[id(index)] = index.match(keys)
    depth = max(depths.get(name, 0) for name in names)
    return min(depth, (len(ids) - 1) // size) * size
