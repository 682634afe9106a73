"""The scheduling benchmark's outputs: a Markdown table, a JSON file and a PNG chart."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from bench.sched_stats import RunResult

COLUMNS = (
    ("requests", "requests", "{:.0f}"),
    ("errors", "errors", "{:.0f}"),
    ("TTFT p50", "ttft_p50_ms", "{:.0f} ms"),
    ("TTFT p99", "ttft_p99_ms", "{:.0f} ms"),
    ("output tok/s", "output_tps", "{:.0f}"),
    ("prefill cache hit rate", "hit_rate", "{:.1%}"),
    ("prefill imbalance", "imbalance", "{:.2f}"),
    ("decode-only", "decode_only_share", "{:.0%}"),
)


def _cell(fmt: str, value: float) -> str:
    return "—" if isinstance(value, float) and math.isnan(value) else fmt.format(value)


def table(results: Sequence[RunResult]) -> str:
    header = ["workload", "policy", *(title for title, _, _ in COLUMNS)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        policy = f"{r.varied}: **{r.policy}** ({_other(r.varied)}: {r.fixed})"
        cells = [r.workload, policy, *(_cell(fmt, getattr(r, key)) for _, key, fmt in COLUMNS)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kind_table(results: Sequence[RunResult]) -> str:
    """TTFT per kind of request, for the workloads that mix kinds (bursty: short and long)."""
    mixed = [r for r in results if r.by_kind]
    kinds = sorted({k for r in mixed for k in r.by_kind})
    if not mixed:
        return ""
    header = ["workload", "policy", *(f"{k} TTFT p{q}" for k in kinds for q in (50, 99))]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in mixed:
        cells = [r.workload, f"{r.varied}: {r.policy}"]
        for k in kinds:
            figures = r.by_kind.get(k, {})
            for q in ("p50_ms", "p99_ms"):
                cells.append(_cell("{:.0f} ms", figures.get(q, math.nan)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _other(role: str) -> str:
    return "decode" if role == "prefill" else "prefill"


def write_json(path: Path, results: Sequence[RunResult], meta: dict[str, Any]) -> None:
    data = {**meta, "results": [r.as_dict() for r in results]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))


def chart(path: Path, results: Sequence[RunResult]) -> None:
    """Per workload: TTFT p50/p99 per policy, and beside it what tells the policies apart
    there: the prefill cache hit rate (chat), short prompts' TTFT (bursty), else the
    prefill imbalance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in results))
    fig, axes = plt.subplots(len(workloads), 2, figsize=(13, 3.2 * len(workloads)), squeeze=False)
    for row, name in zip(axes, workloads, strict=True):
        runs = [r for r in results if r.workload == name]
        _pair_bars(row[0], runs, [r.ttft_p50_ms for r in runs], [r.ttft_p99_ms for r in runs])
        row[0].set_title(f"{name}: TTFT by {runs[0].varied} policy")
        _side_panel(row[1], name, runs)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=2)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _pair_bars(ax: Any, runs: Sequence[RunResult], p50: list[float], p99: list[float]) -> None:
    xs = range(len(runs))
    ax.bar([x - 0.2 for x in xs], _finite(p50), 0.4, label="p50", color="tab:blue")
    ax.bar([x + 0.2 for x in xs], _finite(p99), 0.4, label="p99", color="tab:orange")
    ax.set_yscale("log")
    ax.set_ylim(bottom=10)
    ax.set_ylabel("ms (log scale)")
    _policy_ticks(ax, runs)


def _side_panel(ax: Any, name: str, runs: Sequence[RunResult]) -> None:
    if any(r.hit_rate > 0 for r in runs):
        ax.bar(range(len(runs)), [100 * x for x in _finite([r.hit_rate for r in runs])], 0.6)
        ax.set_ylim(0, 100)
        ax.set_ylabel("% of prompt tokens")
        ax.set_title(f"{name}: prefill prefix-cache hit rate")
        _policy_ticks(ax, runs)
    elif all("short" in r.by_kind for r in runs):
        short = [r.by_kind["short"] for r in runs]
        _pair_bars(ax, runs, [k["p50_ms"] for k in short], [k["p99_ms"] for k in short])
        ax.set_title(f"{name}: short prompts' TTFT")
    else:
        ax.bar(range(len(runs)), _finite([r.imbalance for r in runs]), 0.6, color="tab:gray")
        ax.set_ylim(bottom=1)
        ax.set_ylabel("max / mean in-flight")
        ax.set_title(f"{name}: prefill load imbalance")
        _policy_ticks(ax, runs)


def _finite(values: Sequence[float]) -> list[float]:
    return [0.0 if math.isnan(v) else v for v in values]


def _policy_ticks(ax: Any, runs: Sequence[RunResult]) -> None:
    ax.set_xticks(range(len(runs)))
    ax.set_xticklabels([r.policy for r in runs], rotation=25, ha="right", fontsize=8)
