"""`make bench`'s outputs: the Markdown tables, the JSON results and what they say of the
run's circumstances (machine, git revision, load), so a figure can be checked later."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from bench.phases import PHASES
from bench.scenarios import Scenario, anchor_verdict, verdict

SCHEMA = "pdproxy-bench/1"
ROOT = Path(__file__).resolve().parent.parent
Rows = Sequence[tuple[Scenario, dict[str, float]]]
Column = tuple[str, str, str]  # title, figure, format

COLUMNS: tuple[Column, ...] = (
    ("req/s direct", "direct_rps", "{:.0f}"),
    ("req/s proxied", "proxied_rps", "{:.0f}"),
    ("TTFT p50 direct", "direct_p50", "{:.2f} ms"),
    ("TTFT p50 proxied", "proxied_p50", "{:.2f} ms"),
    ("TTFT p99 direct", "direct_p99", "{:.2f} ms"),
    ("TTFT p99 proxied", "proxied_p99", "{:.2f} ms"),
    ("added TTFT p50", "added_p50", "{:+.2f} ms"),
    ("added TTFT p99", "added_p99", "{:+.2f} ms"),
    ("proxy CPU/request", "cpu_ms", "{:.3f} ms"),
    ("errors", "errors", "{:.0f}"),
)

ANCHOR_COLUMNS: tuple[Column, ...] = (
    ("CPU/request pdproxy", "cpu_ms", "{:.3f} ms"),
    ("CPU/request vllm-router", "anchor_cpu_ms", "{:.3f} ms"),
    ("CPU pdproxy ÷ vllm-router", "cpu_ratio", "{:.2f}x"),
    ("added TTFT p50 pdproxy", "added_p50", "{:+.2f} ms"),
    ("added TTFT p50 vllm-router", "anchor_added_p50", "{:+.2f} ms"),
    ("p50 pdproxy - vllm-router", "added_p50_diff", "{:+.2f} ms"),
    ("added TTFT p99 pdproxy", "added_p99", "{:+.2f} ms"),
    ("added TTFT p99 vllm-router", "anchor_added_p99", "{:+.2f} ms"),
    ("p99 pdproxy - vllm-router", "added_p99_diff", "{:+.2f} ms"),
    ("req/s pdproxy", "proxied_rps", "{:.0f}"),
    ("req/s vllm-router", "anchor_rps", "{:.0f}"),
    ("errors vllm-router", "anchor_errors", "{:.0f}"),
)


def table(rows: Rows, extra: Sequence[Column] = ()) -> str:
    """The main table: direct against pdproxy, issue 3's targets; ``extra``: a variant's."""
    return _table(rows, (*COLUMNS, *extra), verdict)


def anchor_table(rows: Rows) -> str:
    """pdproxy beside vllm-router, for the scenarios where both ran ('' if none did)."""
    both = [(s, r) for s, r in rows if "anchor_cpu_ms" in r]
    return _table(both, ANCHOR_COLUMNS, anchor_verdict) if both else ""


def phase_table(rows: Rows) -> str:
    """pdproxy's TTFT by phase, p50 and p99, a column pair per scenario that traced it, with
    its event loop's lag and, when it ran, vllm-router's whole added TTFT ('' if none)."""
    traced = [(s, r) for s, r in rows if r.get("phase_requests")]
    if not traced:
        return ""
    header = ["phase", *(f"{s.letter} {q}" for s, _ in traced for q in ("p50", "p99"))]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    entries = [(title, f"phase_{key}_{{}}", "{:.2f} ms") for key, title in PHASES]
    entries += [
        ("pdproxy: added TTFT (proxied - direct)", "added_{}", "{:+.2f} ms"),
        ("vllm-router: added TTFT (no trace)", "anchor_added_{}", "{:+.2f} ms"),
        ("pdproxy: event-loop lag (/health every 10 ms)", "loop_lag_{}", "{:.2f} ms"),
    ]
    for title, key, fmt in entries:
        cells = [_cell(fmt, r, key.format(q)) for _, r in traced for q in ("p50", "p99")]
        if any(c != "—" for c in cells):
            lines.append("| " + " | ".join([title, *cells]) + " |")
    joined = ", ".join(f"{s.letter}: {r['phase_requests']:.0f}" for s, r in traced)
    return "\n".join([*lines, "", f"requests joined with their access lines: {joined}"])


def _table(rows: Rows, columns: Sequence[Column], judge: Any) -> str:
    header = ["scenario", *(title for title, _, _ in columns), "target"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s, r in rows:
        cells = [s.name, *(_cell(fmt, r, key) for _, key, fmt in columns), judge(s, r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(fmt: str, row: dict[str, float], key: str) -> str:
    value = row.get(key)
    return "—" if value is None or value != value else fmt.format(value)


def markdown(rows: Rows, meta: dict[str, Any], extra: Sequence[Column] = ()) -> str:
    m = meta["machine"]
    git = meta["git"]
    revision = f"{git['revision'][:12]}{' (uncommitted changes)' if git['dirty'] else ''}"
    before, after = meta["load"]["before"], meta["load"]["after"]
    lines = [
        f"machine: {m['arch']}, {m['cores']} cores, {m['memory_gib']:.0f} GiB, {m['cpu']},"
        f" Python {m['python']}",
        f"pdproxy: {revision}, default flags (the headline), {meta.get('variant') or 'no'}"
        f" variant beside; load average {before[0]:.2f} before, {after[0]:.2f} after",
        "",
        table(rows, extra),
    ]
    versus = anchor_table(rows)
    if versus:
        anchor = meta["anchor"]
        lines += ["", f"pdproxy beside {anchor['name']} {anchor['version']}:", "", versus]
    by_phase = phase_table(rows)
    if by_phase:
        lines += ["", "pdproxy's time to first byte by phase (its access lines):", "", by_phase]
    return "\n".join(lines)


def subtitle(meta: dict[str, Any]) -> str:
    """The chart's footnote: revision, time, machine and load."""
    git, m, load = meta["git"], meta["machine"], meta["load"]
    dirty = " + uncommitted changes" if git["dirty"] else ""
    return (
        f"pdproxy {git['revision'][:12]}{dirty}, {meta['started_at']}, {m['cores']} cores"
        f" ({m['cpu']}), load average {load['before'][0]:.1f} before, {load['after'][0]:.1f} after"
    )


def environment(argv: Sequence[str]) -> dict[str, Any]:
    """What the JSON records of the run's circumstances, taken at its start."""
    return {
        "schema": SCHEMA,
        "started_at": _now(),
        "command": list(argv),
        "git": git_state(ROOT),
        "machine": machine(),
        "load": {"before": list(os.getloadavg())},
    }


def finish(meta: dict[str, Any]) -> dict[str, Any]:
    return {**meta, "finished_at": _now(), "load": {**meta["load"], "after": os.getloadavg()}}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def git_state(root: Path) -> dict[str, Any]:
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    return {
        "revision": git("rev-parse", "HEAD") or "unknown",
        "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def machine() -> dict[str, Any]:
    return {
        "arch": platform.machine(),
        "cores": os.cpu_count(),
        "cpu": _proc_field("/proc/cpuinfo", "model name") or platform.processor() or "unknown",
        "memory_gib": int((_proc_field("/proc/meminfo", "MemTotal") or "0 kB").split()[0]) / 2**20,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "implementation": sys.implementation.name,
    }


def _proc_field(path: str, name: str) -> str | None:
    try:
        with open(path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return None


def results(rows: Rows, meta: dict[str, Any], quick: bool, rounds: int) -> dict[str, Any]:
    return {
        **meta,
        "quick": quick,
        "scenarios": [
            {
                "id": s.letter,
                "name": s.name,
                "load": s.load(quick, rounds),
                "figures": r,
                "target": verdict(s, r),
                "anchor_target": anchor_verdict(s, r),
            }
            for s, r in rows
        ],
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2))
