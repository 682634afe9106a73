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
from pdproxy.scheduling.kv_events import KVIndex
from pdproxy.scheduling.kv_keys import block_keys, instance_name
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
        self._positions: (
            tuple[tuple[int, int], Sequence[EndpointView], dict[str, int], list[int]] | None
        ) = None

    def score(self, ctx: Context, endpoints: Sequence[EndpointView]) -> list[float]:
        return self._measure(ctx, endpoints, in_tokens=False)

    def cached_tokens(self, ctx: Context, endpoints: Sequence[EndpointView]) -> list[float]:
        """The prompt tokens each instance is predicted to find cached (0 under
        ``min_share``): its events' hit where followed, else the approximate index's share
        of the prompt's tokens."""
        return self._measure(ctx, endpoints, in_tokens=True)

    def _measure(
        self, ctx: Context, endpoints: Sequence[EndpointView], *, in_tokens: bool
    ) -> list[float]:
        """Each instance's hit: a share of the prompt, or (``in_tokens``) its tokens."""
        ids = ctx.features.token_ids
        index = self.index
        if ids is None or not index.live or index.block_size < 1:
            shares = self.fallback.score(ctx, endpoints)
            return [s * ctx.features.tokens for s in shares] if in_tokens else shares
        depths = _depths(ctx, index, ids)
        positions, unfollowed = self._positions_of(endpoints)
        scores = [0.0] * len(endpoints)
        if unfollowed:  # the approximate index's word for those
            approximate = self.fallback.score(ctx, endpoints)
            scale = float(len(ids)) if in_tokens else 1.0
            for at in unfollowed:
                scores[at] = approximate[at] * scale
        most = (len(ids) - 1) // index.block_size  # blocks vLLM may hit
        if most < 1:
            return scores
        floor = max(self.min_share * most, 1)
        size = index.block_size
        for name, depth in depths.items():  # only the instances holding the first block
            where = positions.get(name)
            if where is not None and depth >= floor:
                hit = min(depth, most)
                scores[where] = max(scores[where], hit * size if in_tokens else hit / most)
        return scores

    def _positions_of(self, endpoints: Sequence[EndpointView]) -> tuple[dict[str, int], list[int]]:
        """Each followed rank's name -> its endpoint's position, and the positions of the
        endpoints with none followed; kept while the sequence (the registry's snapshot)
        and the followed set last."""
        key = (id(endpoints), self.index.live_version)
        cached = self._positions
        if cached is not None and cached[0] == key and cached[1] is endpoints:
            return cached[2], cached[3]
        live = self.index.live
        positions: dict[str, int] = {}
        unfollowed = []
        for at, e in enumerate(endpoints):
            names = [n for r in range(max(e.dp_size, 1)) if (n := instance_name(e.url, r)) in live]
            positions.update(dict.fromkeys(names, at))
            if not names:
                unfollowed.append(at)
        self._positions = (key, endpoints, positions, unfollowed)
        return positions, unfollowed


def predicted_tokens(ctx: Context, index: KVIndex, endpoint: EndpointView) -> int | None:
    """The prompt tokens ``endpoint``'s engine will find cached, from its events; None
    when its events are not followed or the request carries no token ids. (An engine the
    self-check distrusts is still predicted, so that it can be trusted again.)"""
    ids = ctx.features.token_ids
    size = index.block_size
    if ids is None or size < 1:
        return None
    depth = _best_depth(endpoint, index.followed, _depths(ctx, index, ids))
    return None if depth is None else min(depth, (len(ids) - 1) // size) * size


def _depths(ctx: Context, index: KVIndex, ids: Sequence[int]) -> dict[str, int]:
    """``index.match`` of the request's blocks, once per decision (both legs share it)."""
    depths = ctx.matches.get(id(index))
    if depths is None:
        depths = ctx.matches[id(index)] = index.match(prompt_keys(ctx, index, ids))
    return depths


def prompt_keys(ctx: Context, index: KVIndex, ids: Sequence[int]) -> tuple[int, ...]:
    """The request's block keys at ``index``'s block size, once per decision."""
    keys = ctx.keys.get(id(index))
    if keys is None:
        keys = ctx.keys[id(index)] = block_keys(
            ids, index.block_size, cache_salt=ctx.features.cache_salt
        )
    return keys


def _best_depth(endpoint: EndpointView, live: set[str], depths: dict[str, int]) -> int | None:
    """The deepest match on any of ``endpoint``'s followed DP ranks; None: none followed."""
    if endpoint.dp_size <= 1:
        name = instance_name(endpoint.url, 0)
        return depths.get(name, 0) if name in live else None
    best: int | None = None
    for rank in range(endpoint.dp_size):
        name = instance_name(endpoint.url, rank)
        if name in live:
            best = max(best or 0, depths.get(name, 0))
    return best
