"""`make bench`'s chart: TTFT p50 and p99 and CPU per request, by scenario, pdproxy beside
the direct connection and, when it ran, beside vllm-router (matplotlib, the `bench` extra).

    python -m bench.plots RESULTS.json OUT.png   # the chart again, from a run's JSON
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from bench.report import Rows, subtitle
from bench.scenarios import SCENARIOS

# (series label, figure prefix, colour): the direct connection has no router, so no CPU bar
SERIES = (
    ("direct to decode", "direct", "tab:gray"),
    ("pdproxy (defaults)", "proxied", "tab:blue"),
    ("vllm-router", "anchor", "tab:orange"),
)
CPU = {"proxied": "cpu_ms", "anchor": "anchor_cpu_ms"}


def chart(path: Path, rows: Rows, title: str = "") -> None:
    """Three panels (TTFT p50, TTFT p99, router CPU per request), a bar group per scenario;
    TTFT on a log scale, since a real engine's is a hundred times a sim's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    sparse = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:e}"[0] in "25" else "")

    present = [s for s in SERIES if any(f"{s[1]}_p50" in r for _, r in rows)]
    labels = [_label(s.name) for s, _ in rows]
    fig, axes = plt.subplots(1, 3, figsize=(5 + 2.2 * len(rows) * 1.5, 4.6), squeeze=False)
    ttft_p50, ttft_p99, cpu = axes[0]
    for ax, q in ((ttft_p50, "p50"), (ttft_p99, "p99")):
        _bars(ax, labels, [(s[0], s[2], [r.get(f"{s[1]}_{q}") for _, r in rows]) for s in present])
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(sparse)
        ax.tick_params(axis="y", which="minor", labelsize=7)
        ax.set_ylabel("ms (log scale)")
        ax.set_title(f"TTFT {q} (client side)")
    routers = [s for s in present if s[1] in CPU]
    _bars(cpu, labels, [(s[0], s[2], [r.get(CPU[s[1]]) for _, r in rows]) for s in routers])
    cpu.set_ylabel("ms of CPU (user + system)")
    cpu.set_title("router CPU per request")
    handles, names = ttft_p50.get_legend_handles_labels()
    fig.legend(handles, names, loc="upper center", ncol=len(present), frameon=False)
    if title:
        fig.text(0.5, 0.005, title, ha="center", va="bottom", fontsize=8, color="dimgray")
    fig.tight_layout(rect=(0, 0.04, 1, 0.92))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _label(name: str) -> str:
    """``(b) 64 concurrent, 128 tokens @200 tok/s`` → two short lines for a tick."""
    head, _, rest = name.partition(" ")
    return head + "\n" + rest.replace(", ", ",\n", 1) if len(rest) > 18 else name


def _bars(ax: Any, labels: list[str], series: Sequence[tuple[str, str, list[Any]]]) -> None:
    width = 0.8 / max(len(series), 1)
    for i, (name, colour, values) in enumerate(series):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))]
        heights = [v if _shown(v) else 0.0 for v in values]
        bars = ax.bar(xs, heights, width, label=name, color=colour)
        for bar, v in zip(bars, values, strict=True):
            if _shown(v):
                ax.annotate(
                    _fmt(v),
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=7)
    ax.margins(y=0.15)


def _shown(v: Any) -> bool:
    return isinstance(v, int | float) and not math.isnan(v) and v > 0


def _fmt(v: float) -> str:
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def rows_of(data: dict[str, Any]) -> Rows:
    """A JSON result's scenarios as (scenario, figures) rows (``null`` figures left out)."""
    by_id = {s.letter: s for s in SCENARIOS}
    return [
        (by_id[entry["id"]], {k: v for k, v in entry["figures"].items() if v is not None})
        for entry in data["scenarios"]
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", type=Path)
    p.add_argument("png", type=Path)
    a = p.parse_args(argv)
    data = orjson.loads(a.results.read_bytes())
    chart(a.png, rows_of(data), subtitle(data))
    print(f"written: {a.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
