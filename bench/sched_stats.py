"""The scheduling benchmark's figures from raw observations. Pure: no I/O."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.fleet import metric_sum, percentile_ms

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
DECODE_ONLY = "pdproxy_decode_only_requests_total"


@dataclass(frozen=True)
class Answer:
    """One request's outcome as the client saw it."""

    kind: str
    ok: bool
    ttft: float  # seconds to the first body bytes
    tokens: int  # completion tokens (the usage chunk, else the content chunks)
    text: str = ""  # the generated text (chat history needs it)
    prompt_tokens: int = 0  # the usage chunk's
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens: the prefill's hit


def inflight(metrics_text: str) -> float:
    """Requests an engine has: running (computing or decoding) plus waiting for a slot."""
    return (metric_sum(metrics_text, RUNNING) or 0.0) + (metric_sum(metrics_text, WAITING) or 0.0)


def imbalance(samples: Sequence[Sequence[float]]) -> float:
    """How unevenly the run's load fell on the engines: the busiest engine's in-flight
    averaged over the run, over the mean of those averages.

    1.0 is a perfect spread; N (the engine count) is everything on one engine. Averaging
    over time first keeps a fleet at low concurrency from scoring badly for being
    discrete (one request on one of four engines is 4.0 in any single sample). NaN if no
    sample saw any load.
    """
    busy = [s for s in samples if s and sum(s) > 0]
    if not busy:
        return math.nan
    engines = len(busy[0])
    averages = [sum(s[i] for s in busy) / len(busy) for i in range(engines)]
    mean = sum(averages) / engines
    return max(averages) / mean if mean > 0 else math.nan


def cache_totals(pages: Sequence[str]) -> tuple[float, float]:
    """(hits, queries) in tokens, summed over the engines' /metrics pages."""
    hits = sum(metric_sum(p, HITS) or 0.0 for p in pages)
    queries = sum(metric_sum(p, QUERIES) or 0.0 for p in pages)
    return hits, queries


def hit_rate(before: tuple[float, float], after: tuple[float, float]) -> float:
    """Share of prompt tokens served from the prefix cache during the run; NaN if none asked."""
    queries = after[1] - before[1]
    return (after[0] - before[0]) / queries if queries > 0 else math.nan


@dataclass(frozen=True)
class RunResult:
    workload: str
    policy: str  # the policy under test
    varied: str  # which role's policy varies: "prefill" or "decode"
    fixed: str  # the other role's policy
    requests: int
    errors: int
    seconds: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    output_tps: float
    hit_rate: float
    imbalance: float
    decode_only_share: float
    by_kind: dict[str, dict[str, float]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Observed:
    """Everything one run measured, before it is summarised."""

    answers: list[Answer]
    seconds: float
    cache_before: tuple[float, float]
    cache_after: tuple[float, float]
    samples: list[list[float]]
    decode_only: float


def ttft_figures(answers: Sequence[Answer]) -> dict[str, float]:
    ttft = [a.ttft for a in answers if a.ok]
    return {
        "n": float(len(answers)),
        "p50_ms": percentile_ms(ttft, 0.5),
        "p99_ms": percentile_ms(ttft, 0.99),
    }


def summarize(workload: str, policy: str, varied: str, fixed: str, obs: Observed) -> RunResult:
    answers = obs.answers
    overall = ttft_figures(answers)
    kinds = sorted({a.kind for a in answers})
    return RunResult(
        workload=workload,
        policy=policy,
        varied=varied,
        fixed=fixed,
        requests=len(answers),
        errors=sum(not a.ok for a in answers),
        seconds=obs.seconds,
        ttft_p50_ms=overall["p50_ms"],
        ttft_p99_ms=overall["p99_ms"],
        output_tps=sum(a.tokens for a in answers) / obs.seconds if obs.seconds > 0 else 0.0,
        hit_rate=hit_rate(obs.cache_before, obs.cache_after),
        imbalance=imbalance(obs.samples),
        decode_only_share=obs.decode_only / len(answers) if answers else 0.0,
        by_kind={k: ttft_figures([a for a in answers if a.kind == k]) for k in kinds}
        if len(kinds) > 1
        else {},
    )
