"""The prefill leg of ``kv-events``: a cached prefix against a queue, in tokens of work.

A prefill's cache saves compute only if the instance holding it is not so busy that the
prompt waits longer than it would take to compute it elsewhere. Each candidate's cost is
the prompt tokens it has to compute before this request's first token:

    cost = (queued prefill tokens * queue weight + this prompt's uncached tokens) * slowness

- queued: its prefill legs in flight, each prompt less its predicted hit
  (``LegCounts.queued_tokens``; an estimate where a request's token count is unknown);
- queue weight (``--kv-queue-weight``, 0.25): the share of that queue a new prompt waits
  for. An engine computes several prompts in one step (vLLM batches up to its
  ``max_num_batched_tokens``), so a queue of one prompt delays the next by far less than
  its length. On the multi-tenant bench (16 requests/s) weight 1.0 (strictly serial) gave
  a hit rate of 50 % and TTFT p90 792 ms, 0.5 59 % and 601 ms, 0.25 62 % and 589 ms, 0
  62 % and 588 ms: cached prefixes were abandoned behind queues the engine absorbs.
  Deep queues are still avoided by the overload filter (docs/scheduling.md);
- uncached: the prompt's tokens less those the instance is predicted to hold
  (``KVEventsScorer.cached_tokens``: its events, else the approximate index);
- slowness: the instance's measured seconds per token over its role's typical
  (``scheduling.speed``; 1.0 until measured).

The cheapest scores 1, the others ``cheapest / cost``, so the usual picker takes the
cheapest (ties by load). A prompt no candidate holds any of scores 0 everywhere, so the
picker's ``SpreadNew`` places the new prefix instead (the cost would send every new prefix
to the one idle instance measured fastest, and thrash its cache). The overload filter
runs first, as for ``prefix-affinity``. Engine load this proxy did not send (other
replicas and clients) is not in tokens: it counts through the overload filter only.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdproxy.scheduling.context import Context
from pdproxy.scheduling.kv_scorer import KVEventsScorer
from pdproxy.scheduling.view import EndpointView


class PrefillCostScorer:
    """``cheapest / cost`` per candidate (see the module); 0 for all when nobody holds
    any of the prompt."""

    type_name = "prefill-cost-scorer"

    def __init__(self, cached: KVEventsScorer, queue_weight: float = 1.0) -> None:
        self.cached = cached
        self.queue_weight = queue_weight

    def score(self, ctx: Context, endpoints: Sequence[EndpointView]) -> list[float]:
        hits = self.cached.cached_tokens(ctx, endpoints)
        if max(hits, default=0.0) <= 0.0:
            return hits  # a new prefix: nobody scored, the picker spreads it
        costs = prefill_costs(ctx, endpoints, hits, self.queue_weight)
        cheapest = min(costs)
        return [cheapest / cost for cost in costs]


def prompt_tokens(ctx: Context) -> float:
    """The prompt's length: its token ids when the request has them, else the estimate."""
    ids = ctx.features.token_ids
    return float(len(ids)) if ids is not None else ctx.features.tokens


def prefill_costs(
    ctx: Context,
    endpoints: Sequence[EndpointView],
    hits: Sequence[float],
    queue_weight: float = 1.0,
) -> list[float]:
    """Each candidate's cost in tokens of work (at least one token). A hit is never more
    than the prompt (``KVEventsScorer.cached_tokens``)."""
    n = prompt_tokens(ctx)
    costs = [
        (e.legs.queued_tokens * queue_weight + n - hit) * e.speed.slowness
        for e, hit in zip(endpoints, hits, strict=True)
    ]
    return costs if min(costs) >= 1.0 else [c if c > 1.0 else 1.0 for c in costs]
