"""Data-parallel rank choice within one instance: the rank with the fewest legs in flight.

The proxy's own per-rank leg counts, or the engine's per-rank running + waiting when its
last scrape is fresh and says more; ties go round the ranks in turn so an idle instance
still spreads its requests.
"""

from __future__ import annotations

from pdproxy.scheduling.context import Context
from pdproxy.scheduling.view import EndpointView


class RankChooser:
    def __init__(self) -> None:
        self._turn = 0

    def choose(self, ctx: Context, endpoint: EndpointView) -> int | None:
        size = endpoint.dp_size
        if size <= 1:
            return None
        loads = _rank_loads(ctx, endpoint, size)
        start = self._turn % size
        self._turn += 1
        return min(range(size), key=lambda r: (loads[r], (r - start) % size))


def _rank_loads(ctx: Context, endpoint: EndpointView, size: int) -> list[float]:
    counts = endpoint.legs.rank_in_flight
    loads = [float(counts[r]) if r < len(counts) else 0.0 for r in range(size)]
    figures = endpoint.load.engine_load
    if figures is not None and figures.ranks and ctx.now - figures.scraped_at <= ctx.max_age:
        for rank in figures.ranks:
            if 0 <= rank.rank < size:
                loads[rank.rank] = max(loads[rank.rank], rank.running + rank.waiting)
    return loads
