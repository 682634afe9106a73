"""An engine's load figures from the text of its Prometheus ``/metrics`` page. Pure: no I/O.

vLLM exports, per data-parallel rank (label ``engine="<rank>"``, beside ``model_name``),
the gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc`` (called ``vllm:gpu_cache_usage_perc`` before 0.9, which is
read when the new name is absent). ``running`` and ``waiting`` are summed over the ranks,
``kv_usage`` is the fullest rank's: one full rank is what makes the engine preempt.

The page is parsed by prometheus_client's own text parser. Only the lines that name one of
these gauges are handed to it: a vLLM page is mostly histogram buckets, and parsing all of
it would cost ~20 ms of the event loop per engine and scrape. Those lines are found with
``str.find`` (``relevant_lines``), not by testing each line in Python: on a 128 KB page that
took ~6 ms of the loop every scrape, a stall each streamed token and new request behind it
waited out.

Staleness is one rule, ``fresh_load``: figures older than ``max_age`` (by default
``STALE_AFTER_INTERVALS`` scrape intervals) are no figures at all.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families

from pdproxy.types import EngineLoad, RankLoad

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_LEGACY = "vllm:gpu_cache_usage_perc"  # vLLM < 0.9
_WANTED = (RUNNING, WAITING, KV_USAGE, KV_USAGE_LEGACY)
_RANK_LABEL = "engine"
# where str.splitlines breaks a line besides "\n" (never in a Prometheus page)
_OTHER_BREAKS = ("\r", "\v", "\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")

STALE_AFTER_INTERVALS = 3  # scrapes a figure may miss before the scheduler ignores it

# rank (None: the series carry no engine label) -> gauge name -> value
_Figures = dict[int | None, dict[str, float]]


def parse_engine_load(text: str, scraped_at: float) -> EngineLoad:
    """The figures of one ``/metrics`` page read at ``scraped_at`` (monotonic).

    Raises ``ValueError`` when the page is not Prometheus text, a figure is missing, or a
    value is negative or not a number. ``ranks`` lists every ``engine`` label seen (one
    entry for a single-rank engine); it is empty when the series carry none (vLLM v0).
    Several series of one rank (a ``pid`` label with several API servers, or several
    model names) are one quantity seen twice: the largest counts.
    """
    by_rank = _collect(_samples(text))
    kv_name = KV_USAGE if any(KV_USAGE in f for f in by_rank.values()) else KV_USAGE_LEGACY
    for name in (RUNNING, WAITING, kv_name):
        if not any(name in figures for figures in by_rank.values()):
            raise ValueError(f"no {name} in the metrics page")
    loads = {rank: _rank_load(rank or 0, figures, kv_name) for rank, figures in by_rank.items()}
    return EngineLoad(
        running=sum(r.running for r in loads.values()),
        waiting=sum(r.waiting for r in loads.values()),
        kv_usage=max(r.kv_usage for r in loads.values()),
        scraped_at=scraped_at,
        ranks=tuple(loads[rank] for rank in sorted(r for r in loads if r is not None)),
    )


def _rank_load(rank: int, figures: dict[str, float], kv_name: str) -> RankLoad:
    return RankLoad(
        rank=rank,
        running=figures.get(RUNNING, 0.0),
        waiting=figures.get(WAITING, 0.0),
        kv_usage=min(figures.get(kv_name, 0.0), 1.0),
    )


def relevant_lines(text: str) -> str:
    """The lines of ``text`` (as ``str.splitlines`` draws them) that contain a wanted
    gauge's name, in order, joined by newlines."""
    if any(mark in text for mark in _OTHER_BREAKS):  # not vLLM's: each line tested
        return "\n".join(line for line in text.splitlines() if any(n in line for n in _WANTED))
    ends: dict[int, int] = {}  # where each relevant line starts -> where it ends
    for name in _WANTED:
        at = text.find(name)
        while at >= 0:
            start = text.rfind("\n", 0, at) + 1
            end = text.find("\n", at)
            ends[start] = end = len(text) if end < 0 else end
            at = text.find(name, end)
    return "\n".join(text[start : ends[start]] for start in sorted(ends))


def _samples(text: str) -> Iterable[tuple[str, dict[str, str], float]]:
    """``(name, labels, value)`` of the wanted gauges' samples; ``ValueError`` on bad text."""
    for family in text_string_to_metric_families(relevant_lines(text)):
        for sample in family.samples:
            if sample.name in _WANTED:
                yield sample.name, sample.labels, sample.value


def _collect(samples: Iterable[tuple[str, dict[str, str], float]]) -> _Figures:
    by_rank: _Figures = {}
    for name, labels, value in samples:
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} is {value}")
        figures = by_rank.setdefault(_rank(labels), {})
        figures[name] = max(value, figures.get(name, value))
    return by_rank


def _rank(labels: dict[str, str]) -> int | None:
    text = labels.get(_RANK_LABEL)
    if text is None:
        return None
    if not text.isdigit():
        raise ValueError(f"engine label {text[:32]!r} is not a rank")
    return int(text)


def max_age(interval: float) -> float:
    """How old figures scraped every ``interval`` seconds may be; 0 when scraping is off."""
    return STALE_AFTER_INTERVALS * interval


def fresh_load(load: EngineLoad | None, now: float, max_age: float) -> EngineLoad | None:
    """``load`` if it is at most ``max_age`` seconds old at ``now`` (monotonic), else None."""
    if load is None or now - load.scraped_at > max_age:
        return None
    return load
