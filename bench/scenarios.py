"""`make bench`'s scenarios, and the figures of one scenario from its measured results.

A scenario's figures are one flat mapping of name to number (the JSON results, the tables
and the plots all read it): ``direct_*`` for the decode engine alone, ``proxied_*`` and
``cpu_ms`` for pdproxy, ``anchor_*`` for vllm-router when it ran, and the comparisons.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from bench.load import Result

QUICK_DIVISOR = 20  # --quick: a twentieth of each scenario's requests (a smoke run)
ANCHOR_TTFT_MS = 1.0  # issue 12: added TTFT within 1 ms of vllm-router's


@dataclass(frozen=True)
class Scenario:
    name: str
    concurrency: int
    max_tokens: int
    decode_tps: float
    total: int
    target_cpu_ms: float | None = None
    target_added_ttft_ms: float | None = None
    real: bool = False  # real vLLM CPU engines instead of simulated ones
    # issue 12's targets against vllm-router in the same run
    anchor_cpu: bool = False  # pdproxy's CPU per request ≤ vllm-router's
    anchor_ttft: bool = False  # added TTFT within ANCHOR_TTFT_MS of vllm-router's, p50 and p99

    @property
    def letter(self) -> str:
        return self.name[1]

    def sizes(self, quick: bool) -> tuple[int, int]:
        """(warm-up requests per path, measured requests per path and round)."""
        if quick:
            return (4 if self.real else 20), max(self.total // QUICK_DIVISOR, 20)
        return (8 if self.real else 200), self.total

    def load(self, quick: bool, rounds: int) -> dict[str, Any]:
        """What the JSON results record of the load."""
        warmup, total = self.sizes(quick)
        fields = asdict(self)
        del fields["total"]
        return {
            **fields,
            "engines": "vllm" if self.real else "sim",
            "warmup_requests": warmup,
            "requests_per_round": total,
            "rounds": rounds,
            # each path's client keeps its connections; a request per worker (not measured)
            # before each round reopens any the server closed while another path ran
            "connections": "kept open across rounds",
        }


SCENARIOS = (
    Scenario("(a) 32 concurrent, 16 tokens", 32, 16, 0, 4000, target_cpu_ms=0.8, anchor_cpu=True),
    Scenario(
        "(b) 64 concurrent, 128 tokens @200 tok/s",
        64,
        128,
        200,
        640,
        target_cpu_ms=4.0,
        anchor_cpu=True,
        anchor_ttft=True,
    ),
    Scenario("(c) one at a time, 16 tokens", 1, 16, 0, 1000, target_added_ttft_ms=1.0),
    Scenario("(d) real vLLM 1P1D (NIXL), 4 concurrent, 16 tokens", 4, 16, 0, 120, real=True),
)


def selected(names: list[str] | None) -> list[Scenario]:
    """The scenarios whose letters are in ``names`` (all when none are given)."""
    return [s for s in SCENARIOS if not names or s.letter in names]


def figures(
    direct: Result,
    proxied: Result,
    cpu: float,
    anchor: Result | None = None,
    anchor_cpu: float = 0.0,
) -> dict[str, float]:
    """Every figure of one scenario; ``cpu`` and ``anchor_cpu`` are the routers' CPU
    seconds over their measured requests."""
    out = {
        "direct_rps": direct.rps,
        "proxied_rps": proxied.rps,
        "direct_p50": direct.ttft_p50_ms,
        "direct_p99": direct.ttft_ms(0.99),
        "proxied_p50": proxied.ttft_p50_ms,
        "proxied_p99": proxied.ttft_ms(0.99),
        "added_p50": proxied.ttft_p50_ms - direct.ttft_p50_ms,
        "added_p99": proxied.ttft_ms(0.99) - direct.ttft_ms(0.99),
        "cpu_ms": 1000 * cpu / max(proxied.requests, 1),
        **_tail("direct", direct),
        **_tail("proxied", proxied),
        "direct_requests": direct.requests,
        "proxied_requests": proxied.requests,
        "direct_errors": direct.errors,
        "proxied_errors": proxied.errors,
        "errors": direct.errors + proxied.errors,
    }
    if anchor is None:
        return out
    a = {
        "anchor_rps": anchor.rps,
        "anchor_p50": anchor.ttft_p50_ms,
        "anchor_p99": anchor.ttft_ms(0.99),
        "anchor_added_p50": anchor.ttft_p50_ms - out["direct_p50"],
        "anchor_added_p99": anchor.ttft_ms(0.99) - out["direct_p99"],
        "anchor_cpu_ms": 1000 * anchor_cpu / max(anchor.requests, 1),
        **_tail("anchor", anchor),
        "anchor_requests": anchor.requests,
        "anchor_errors": anchor.errors,
    }
    return {
        **out,
        **a,
        "errors": out["errors"] + anchor.errors,
        "cpu_ratio": out["cpu_ms"] / a["anchor_cpu_ms"] if a["anchor_cpu_ms"] else float("nan"),
        "added_p50_diff": out["added_p50"] - a["anchor_added_p50"],
        "added_p99_diff": out["added_p99"] - a["anchor_added_p99"],
    }


def _tail(path: str, r: Result) -> dict[str, float]:
    """More of the TTFT distribution than the table shows: p90, p99.9 and the slowest."""
    return {
        f"{path}_p90": r.ttft_ms(0.9),
        f"{path}_p999": r.ttft_ms(0.999),
        f"{path}_max": r.ttft_ms(1),
    }


def verdict(scenario: Scenario, row: dict[str, float]) -> str:
    """Issue 3's targets for pdproxy alone."""
    checks = []
    if scenario.target_cpu_ms is not None:
        ok = row["cpu_ms"] <= scenario.target_cpu_ms
        checks.append(f"CPU ≤ {scenario.target_cpu_ms} ms: {_met(ok)}")
    if scenario.target_added_ttft_ms is not None:
        ok = row["added_p50"] <= scenario.target_added_ttft_ms
        checks.append(f"added TTFT ≤ {scenario.target_added_ttft_ms} ms: {_met(ok)}")
    return "; ".join(checks)


def anchor_verdict(scenario: Scenario, row: dict[str, float]) -> str:
    """Issue 12's targets against vllm-router measured in the same run."""
    if "anchor_cpu_ms" not in row:
        return ""
    checks = []
    if scenario.anchor_cpu:
        checks.append(f"CPU ≤ 1.0x vllm-router: {_met(row['cpu_ratio'] <= 1.0)}")
    if scenario.anchor_ttft:
        ok = max(row["added_p50_diff"], row["added_p99_diff"]) <= ANCHOR_TTFT_MS
        checks.append(f"added TTFT within {ANCHOR_TTFT_MS:g} ms at p50 and p99: {_met(ok)}")
    return "; ".join(checks)


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"
