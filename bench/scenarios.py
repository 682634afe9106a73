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
# issue 24's targets against vllm-router in the same run: CPU per request at most 0.9x its
# own; added TTFT at most its own at p99, and no more than 0.5 ms over it at p50
ANCHOR_CPU_RATIO = 0.9
ANCHOR_TTFT_P50_MS = 0.5
ANCHOR_TTFT_P99_MS = 0.0


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
    # issue 24's targets against vllm-router in the same run
    anchor_cpu: bool = False  # pdproxy's CPU per request ≤ ANCHOR_CPU_RATIO x vllm-router's
    anchor_ttft: bool = False  # added TTFT within ANCHOR_TTFT_P50_MS/_P99_MS of vllm-router's
    api: str = "completions"  # a key of bench.load.APIS
    phases: bool = False  # pdproxy's TTFT by phase and its event loop's lag, measured too

    @property
    def letter(self) -> str:
        """The scenario's id, between the name's parentheses: ``a``, ``a-chat``."""
        return self.name[1 : self.name.index(")")]

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


_A = "32 concurrent, 16 tokens"
_B = "64 concurrent, 128 tokens @200 tok/s"
SCENARIOS = (
    Scenario(f"(a) {_A}", 32, 16, 0, 4000, target_cpu_ms=0.8, anchor_cpu=True),
    Scenario(f"(a-chat) {_A}, chat", 32, 16, 0, 4000, 0.8, anchor_cpu=True, api="chat"),
    Scenario(f"(b) {_B}", 64, 128, 200, 640, 4.0, anchor_cpu=True, anchor_ttft=True, phases=True),
    Scenario(
        f"(b-chat) {_B}, chat",
        *(64, 128, 200, 640, 4.0),
        anchor_cpu=True,
        anchor_ttft=True,
        api="chat",
        phases=True,
    ),
    Scenario("(c) one at a time, 16 tokens", 1, 16, 0, 1000, target_added_ttft_ms=1.0),
    Scenario("(d) real vLLM 1P1D (NIXL), 4 concurrent, 16 tokens", 4, 16, 0, 120, real=True),
)


def selected(names: list[str] | None) -> list[Scenario]:
    """The scenarios whose ids are in ``names`` (all when none are given)."""
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
    """Issue 24's targets against vllm-router measured in the same run."""
    if "anchor_cpu_ms" not in row:
        return ""
    checks = []
    if scenario.anchor_cpu:
        ok = row["cpu_ratio"] <= ANCHOR_CPU_RATIO
        checks.append(f"CPU ≤ {ANCHOR_CPU_RATIO:g}x vllm-router: {_met(ok)}")
    if scenario.anchor_ttft:
        p50 = row["added_p50_diff"] <= ANCHOR_TTFT_P50_MS
        p99 = row["added_p99_diff"] <= ANCHOR_TTFT_P99_MS
        checks.append(f"added TTFT p50 ≤ vllm-router's +{ANCHOR_TTFT_P50_MS:g} ms: {_met(p50)}")
        checks.append(f"added TTFT p99 ≤ vllm-router's: {_met(p99)}")
    return "; ".join(checks)


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"
