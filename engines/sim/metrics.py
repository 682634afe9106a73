"""Counters and gauges of one sim engine, rendered as Prometheus text with vLLM's names."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Counters:
    """Plain counters; the sim's own ones are named after their `sim_*` metric."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    tokens_external_kv_transfer: int = 0
    tokens_local_compute: int = 0
    tokens_local_cache_hit: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    requests_finished_length: int = 0
    requests_finished_stop: int = 0
    requests_finished_abort: int = 0
    kv_bytes_sent: int = 0
    kv_bytes_received: int = 0
    kv_transfers: int = 0
    kv_blocks_loaded: int = 0  # a decode's prompt blocks its prefix cache lacked
    kv_blocks_local_hit: int = 0  # a decode's prompt blocks its prefix cache held
    kv_load_failures: int = 0
    kv_invalid_params: int = 0
    kv_leases_expired: int = 0
    kv_released_on_reject: int = 0
    kv_release_unknown: int = 0
    contract_violations: int = 0
    client_disconnects: int = 0
    requests_received: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RankGauges:
    """One DP rank's gauges; vLLM labels them `engine="<rank>"`."""

    running: int
    waiting: int
    kv_usage: float


@dataclass(frozen=True)
class Gauges:
    """Totals over the ranks, and `ranks` one by one (empty: rank 0 has the totals)."""

    running: int
    waiting: int
    kv_usage: float
    ranks: tuple[RankGauges, ...] = ()

    def per_rank(self) -> tuple[RankGauges, ...]:
        return self.ranks or (RankGauges(self.running, self.waiting, self.kv_usage),)


_SIM_COUNTERS = (
    ("sim_kv_bytes_sent_total", "kv_bytes_sent", "KV bytes served to decode engines."),
    ("sim_kv_bytes_received_total", "kv_bytes_received", "KV bytes loaded from prefill."),
    ("sim_kv_transfers_total", "kv_transfers", "Successful KV transfers (either side)."),
    (
        "sim_kv_blocks_loaded_total",
        "kv_blocks_loaded",
        "Prompt KV blocks a decode loaded over the connector (not in its prefix cache).",
    ),
    (
        "sim_kv_blocks_local_hit_total",
        "kv_blocks_local_hit",
        "Prompt KV blocks a decode already held in its prefix cache (not loaded).",
    ),
    ("sim_kv_load_failures_total", "kv_load_failures", "KV loads that failed (recomputed)."),
    ("sim_kv_invalid_params_total", "kv_invalid_params", "Invalid kv_transfer_params seen."),
    ("sim_kv_leases_expired_total", "kv_leases_expired", "Held KV freed by lease expiry."),
    (
        "sim_kv_released_on_reject_total",
        "kv_released_on_reject",
        "Held KV freed because the decode rejected its request.",
    ),
    (
        "sim_kv_release_unknown_total",
        "kv_release_unknown",
        "Release notices for requests whose KV is not held.",
    ),
    ("sim_contract_violations_total", "contract_violations", "Unclamped prefill requests."),
    ("sim_client_disconnects_total", "client_disconnects", "Requests aborted by disconnect."),
    ("sim_requests_received_total", "requests_received", "Generation requests received."),
)


def render(c: Counters, g: Gauges, model: str) -> str:
    """The /metrics body."""
    labels = f'engine="0",model_name="{model}"'
    out: list[str] = []
    add = _adder(out, labels)
    _gauges(out, model, g.per_rank())
    add(
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        c.prompt_tokens,
    )
    add(
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        c.generation_tokens,
    )
    add(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        c.prefix_cache_queries,
    )
    add(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        c.prefix_cache_hits,
    )
    _by_source(out, labels, c)
    _finished(out, labels, c)
    for name, attr, help_text in _SIM_COUNTERS:
        add(name, "counter", help_text, getattr(c, attr))
    return "\n".join(out) + "\n"


_RANK_GAUGES = (
    ("vllm:num_requests_running", "running", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "waiting", "Number of requests waiting to be processed."),
    ("vllm:kv_cache_usage_perc", "kv_usage", "KV-cache usage. 1 means 100 percent usage."),
)


def _gauges(out: list[str], model: str, ranks: tuple[RankGauges, ...]) -> None:
    """One series per DP rank, as vLLM's PrometheusStatLogger (`engine` = the rank)."""
    for name, attr, help_text in _RANK_GAUGES:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} gauge")
        for rank, g in enumerate(ranks):
            value = float(getattr(g, attr))
            out.append(f'{name}{{engine="{rank}",model_name="{model}"}} {value}')


def _adder(out: list[str], labels: str) -> Callable[[str, str, str, float], None]:
    def add(name: str, kind: str, help_text: str, value: float) -> None:
        out.append(f"# HELP {name} {help_text}")
        out.append(f"# TYPE {name} {kind}")
        out.append(f"{name}{{{labels}}} {float(value)}")

    return add


def _by_source(out: list[str], labels: str, c: Counters) -> None:
    name = "vllm:prompt_tokens_by_source_total"
    out.append(f"# HELP {name} Number of prompt tokens by source.")
    out.append(f"# TYPE {name} counter")
    for source, value in (
        ("local_compute", c.tokens_local_compute),
        ("local_cache_hit", c.tokens_local_cache_hit),
        ("external_kv_transfer", c.tokens_external_kv_transfer),
    ):
        out.append(f'{name}{{{labels},source="{source}"}} {float(value)}')


def _finished(out: list[str], labels: str, c: Counters) -> None:
    name = "vllm:request_success_total"
    out.append(f"# HELP {name} Count of successfully processed requests.")
    out.append(f"# TYPE {name} counter")
    for reason, value in (
        ("length", c.requests_finished_length),
        ("stop", c.requests_finished_stop),
        ("abort", c.requests_finished_abort),
    ):
        out.append(f'{name}{{{labels},finished_reason="{reason}"}} {float(value)}')


def parse_metrics(text: str) -> dict[str, float]:
    """Parse Prometheus text into {'name{labels}': value} and {'name': sum over labels}."""
    result: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        result[key] = float(value)
        bare = key.split("{", 1)[0]
        result[bare] = result.get(bare, 0.0) + float(value) if bare != key else float(value)
    return result
