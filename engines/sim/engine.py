"""The engine core: prefill with KV sources, token generation, and the P-side finish."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from engines.sim import model
from engines.sim.config import SimConfig
from engines.sim.connectors import Connector, ConnectorDeps, create
from engines.sim.kvstore import BlockPool, PrefixCache
from engines.sim.metrics import Counters, Gauges, RankGauges
from engines.sim.openai_api import GenRequest
from engines.sim.ranks import Rank, make_ranks
from engines.sim.render import Outcome

Step = tuple[str, "str | None", "str | None"]  # (text piece, finish_reason, stop_reason)


@dataclass
class Prefill:
    kv: list[bytes]
    cached: int  # tokens from the local prefix cache
    external: int  # tokens whose KV came from a connector
    computed: int  # tokens computed here

    def overhead_s(self, cfg: SimConfig) -> float:
        """The fixed part of the time to first token (not compute: it never queues)."""
        return cfg.ttft_ms / 1000

    def compute_s(self, cfg: SimConfig) -> float:
        """Compute time of the tokens computed here (cache hits and loaded KV cost nothing)."""
        return cfg.prefill_us_per_token * self.computed / 1e6


class Engine:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.counters = Counters()
        self.pool = BlockPool(config.num_blocks)
        self.prefix = PrefixCache(config.prefix_cache_blocks, config.block_size)
        self.ranks = make_ranks(
            config.dp_size,
            config.max_running,
            config.prefill_concurrency,
            config.scheduling_policy == "priority",
        )
        self.connector: Connector = create(ConnectorDeps(config, self.counters, self.pool))
        self.dead: str | None = None  # why the engine core died; it then serves nothing

    def rank_of(self, req: GenRequest) -> Rank:
        """The engine core that runs `req`: its X-data-parallel-rank, else rank 0."""
        return self.ranks[req.dp_rank or 0]

    def gauges(self) -> Gauges:
        """Totals, and per rank; blocks held for remote decodes count on rank 0."""
        held = self.connector.held_blocks()
        per_rank = tuple(
            RankGauges(
                r.scheduler.running,
                r.scheduler.waiting,
                self._usage(r.running_blocks + (held if i == 0 else 0)),
            )
            for i, r in enumerate(self.ranks)
        )
        used = held + sum(r.running_blocks for r in self.ranks)
        running = sum(g.running for g in per_rank)
        return Gauges(running, sum(g.waiting for g in per_rank), self._usage(used), per_rank)

    def _usage(self, blocks: int) -> float:
        return min(1.0, blocks / self.config.num_blocks)

    def blocks_for(self, req: GenRequest) -> int:
        return -(-len(req.prompt_tokens) // self.config.block_size)

    def prefill(self, req: GenRequest, loaded: list[bytes] | None) -> Prefill:
        """Build the prompt's KV from loaded entries, the prefix cache and local compute."""
        tokens = req.prompt_tokens
        n = len(tokens)
        c = self.counters
        c.prompt_tokens += n
        if loaded:
            external = min(len(loaded), n - 1)
            kv = model.extend_kv(loaded[:external], tokens, external, req.model)
            self._count_loaded_blocks(kv, tokens, external)
            c.tokens_external_kv_transfer += external
            c.tokens_local_compute += n - external
            return Prefill(kv, _reported_cached(req, external), external, n - external)
        kv = model.compute_kv(tokens, req.model)
        cached = self.prefix.match_and_insert(kv, tokens)
        c.prefix_cache_queries += n
        c.prefix_cache_hits += cached
        c.tokens_local_cache_hit += cached
        c.tokens_local_compute += n - cached
        return Prefill(kv, cached, 0, n - cached)

    def _count_loaded_blocks(self, kv: list[bytes], tokens: list[int], external: int) -> None:
        """A decode's prefix cache as vLLM's: the blocks it already holds are not loaded
        (the connector reads only the rest), and what it received is cached (and, with
        events, published). The sim's side channel still carries the whole prompt; the
        counters say what vLLM would have moved."""
        bs = self.config.block_size
        held = self.prefix.match_and_insert(kv, tokens) // bs
        self.counters.kv_blocks_local_hit += held
        self.counters.kv_blocks_loaded += max(0, -(-external // bs) - held)

    def steps(self, req: GenRequest, pre: Prefill) -> Iterator[Step]:
        """Generated pieces; the last one carries finish_reason (and stop_reason)."""
        words = model.decode_words(pre.kv[-1])
        min_tokens = req.options.get("min_tokens") or 0
        text = ""
        for i in range(req.max_tokens):
            word = next(words)
            piece = " " + word
            req.output_ids.append(model.token_id(word))
            self.counters.generation_tokens += 1
            if req.stop and i + 1 > min_tokens:  # vLLM: stop strings once past min_tokens
                hit = _find_stop(text + piece, req.stop)
                if hit is not None:
                    idx, stop = hit
                    yield (text + piece)[len(text) : max(idx, len(text))], "stop", stop
                    return
            text += piece
            yield piece, ("length" if i == req.max_tokens - 1 else None), None

    def finish(
        self,
        req: GenRequest,
        pre: Prefill,
        text: str,
        n_tokens: int,
        reason: str,
        stop_reason: str | None,
    ) -> Outcome:
        """Account a finished request and let the connector hold/store its KV."""
        if reason == "stop":
            self.counters.requests_finished_stop += 1
        else:
            self.counters.requests_finished_length += 1
        params = self.connector.finished(req, pre.kv)
        if params is not None and params.get("do_remote_prefill"):
            # vLLM's scheduler: P's own prefix-cache hit travels in the handoff, so that
            # the decode reports it instead of its transfer's (~100 %) hit.
            params["remote_prefill_cached_tokens"] = pre.cached
        # vLLM's prefill stats: full blocks this engine computed and wrote to its cache
        bs = self.config.block_size
        created = max(0, len(req.prompt_tokens) // bs * bs - pre.cached - pre.external)
        return Outcome(text, n_tokens, reason, stop_reason, pre.cached, params, created)


def _reported_cached(req: GenRequest, external: int) -> int:
    """The cached tokens a decode that loaded ``external`` tokens of KV reports: the
    prefill's hit when its handoff carries it (vLLM 0.32's output processor), else the
    loaded tokens, as vLLM counts them computed before this step."""
    params = req.kv_transfer_params or {}
    cached = params.get("remote_prefill_cached_tokens")
    if params.get("do_remote_prefill") and type(cached) is int:
        return cached
    return external


def _find_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for s in stops:
        idx = text.find(s)
        if idx >= 0 and (best is None or idx < best[0]):
            best = (idx, s)
    return best
