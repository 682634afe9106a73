"""The committed metrics contract (tests/unit/metrics_contract.txt) and a reader of the
Prometheus text exposition, for the tests that hold /metrics and the dashboard to it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

CONTRACT_PATH = Path(__file__).parent / "unit" / "metrics_contract.txt"
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="(?:[^"\\]|\\.)*"')


@dataclass(frozen=True)
class Family:
    name: str
    type: str
    labels: frozenset[str]


def load_contract() -> dict[str, Family]:
    families = {}
    for line in CONTRACT_PATH.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, kind, labels = line.split()
        names = frozenset() if labels == "-" else frozenset(labels.split(","))
        families[name] = Family(name, kind, names)
    return families


def base_name(series: str, families: dict[str, str] | dict[str, Family]) -> str:
    """The family a series name belongs to (a histogram's _bucket/_sum/_count stripped)."""
    if series in families:
        return series
    for suffix in HISTOGRAM_SUFFIXES:
        if series.endswith(suffix) and series[: -len(suffix)] in families:
            return series[: -len(suffix)]
    return series


def parse_exposition(text: str) -> tuple[dict[str, str], dict[str, set[frozenset[str]]]]:
    """``({family: type}, {family: {label sets of its samples}})``; ``_created`` series
    and a histogram's ``le`` are left out."""
    types: dict[str, str] = {}
    samples: dict[str, set[frozenset[str]]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            if not name.endswith("_created"):
                types[name] = kind
            continue
        match = _SAMPLE.match(line)
        if match is None or match.group(1).endswith("_created"):
            continue
        labels = frozenset(_LABEL.findall(match.group(2) or "")) - {"le"}
        samples.setdefault(base_name(match.group(1), types), set()).add(labels)
    return types, samples
