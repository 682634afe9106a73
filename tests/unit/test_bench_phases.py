"""`make bench`'s per-phase breakdown and event-loop lag, on synthetic inputs: the access
line parsed in both formats, each phase derived from the intervals, the join with the
client's stamps, the lag against the idle probe, and the table that prints them."""

from __future__ import annotations

import json

import pytest

from bench import load, phases, report
from bench.loop_probe import lag
from bench.scenarios import SCENARIOS, figures

B_CHAT = SCENARIOS[3]
TIMES = {
    "prefill_sent_ms": 0.4,
    "prefill_ms": 3.0,
    "decode_sent_ms": 3.9,
    "decode_headers_ms": 2.0,
    "ttfb_ms": 6.5,
}


def _text(rid: str, **times: object) -> str:
    pairs = " ".join(f"{k}={v}" for k, v in times.items())
    return (
        "2026-12-02 10:39:36,848 INFO pdproxy.access: request finished endpoint=/v1/completions"
        f" status=200 prefill_url=http://127.0.0.1:1 {pairs} decode_only=false request_id={rid}"
    )


def test_access_lines_are_read_in_both_formats_and_nothing_else():
    as_json = {"logger": "pdproxy.access", "request_id": "j1", **TIMES}
    other = {"logger": "uvicorn.error", "request_id": "x", "msg": "ttfb_ms=1"}
    lines = phases.access_lines(
        [
            _text("t1", **TIMES),
            json.dumps(as_json),
            json.dumps(other),
            "2026-12-02 INFO uvicorn.error: Started server process request_id=u1",
            "{not json",
        ]
    )
    assert set(lines) == {"t1", "j1"}
    assert {k: lines["t1"][k] for k in TIMES} == TIMES == {k: lines["j1"][k] for k in TIMES}
    assert phases.access_lines([_text("t2", prefill_sent_ms="-")])["t2"]["prefill_sent_ms"] is None


def test_every_millisecond_of_the_ttft_goes_to_one_phase():
    lines = phases.access_lines([_text("r1", **TIMES), _text("r2", **{**TIMES, "prefill_ms": "-"})])
    got = phases.samples({"r1": 0.0085, "r2": 0.009, "lost": 0.01}, lines)
    one = {key: values[0] for key, values in got.items()}
    assert all(len(values) == 1 for values in got.values())  # r2 had no prefill, lost no line
    assert one == pytest.approx(
        {
            "to_prefill": 0.4,
            "prefill": 3.0,
            "to_decode": 0.5,
            "decode_headers": 2.0,
            "to_first_byte": 0.6,
            "ttfb": 6.5,
            "outside": 2.0,
            "client_ttft": 8.5,
        }
    )
    parts = ("to_prefill", "prefill", "to_decode", "decode_headers", "to_first_byte", "outside")
    assert sum(one[k] for k in parts) == pytest.approx(one["client_ttft"])


def test_phase_figures_are_percentiles_over_the_joined_requests():
    samples = {key: [float(i) for i in range(1, 101)] for key, _ in phases.PHASES}
    out = phases.figures(samples)
    assert out["phase_requests"] == 100
    assert out["phase_ttfb_p50"] == 51.0 and out["phase_prefill_p99"] == 100.0
    assert phases.figures({key: [] for key, _ in phases.PHASES}) == {"phase_requests": 0}


def test_loop_lag_is_the_latency_under_load_over_the_idle_median():
    idle = [(t * 0.01, 0.0002) for t in range(100)]
    busy = [(1.0 + t * 0.01, 0.0002 + (0.005 if t % 50 == 0 else 0.0001)) for t in range(100)]
    after = [(3.0, 1.0)]  # past the load's end: left out
    out = lag([*idle, *busy, *after], start=1.0, end=2.0)
    assert out["loop_probes"] == 100 and out["loop_idle_ms"] == pytest.approx(0.2)
    assert out["loop_lag_p50"] == pytest.approx(0.1) and out["loop_lag_p99"] == pytest.approx(5.0)
    assert out["loop_lag_max"] == pytest.approx(5.0)
    assert lag(busy, start=1.0, end=2.0) == {}  # no idle baseline: no figure


def test_the_phase_table_sits_beside_both_routers_added_ttft():
    direct = load.Result(2, 0, 1.0, [0.001, 0.002])
    row = figures(direct, load.Result(2, 0, 1.0, [0.009, 0.010]), 0.01)
    row.update(anchor_added_p50=1.5, anchor_added_p99=2.5, loop_lag_p50=0.3, loop_lag_p99=4.0)
    row.update(phases.figures({key: [1.0, 2.0] for key, _ in phases.PHASES}))
    text = report.phase_table([(B_CHAT, row)])
    assert text.startswith("| phase | b-chat p50 | b-chat p99 |")
    assert "| arrival → prefill sent | 2.00 ms | 2.00 ms |" in text
    assert "| vllm-router: added TTFT (no trace) | +1.50 ms | +2.50 ms |" in text
    assert "| pdproxy: event-loop lag (/health every 10 ms) | 0.30 ms | 4.00 ms |" in text
    assert text.endswith("requests joined with their access lines: b-chat: 2")
    assert report.phase_table([(B_CHAT, {"cpu_ms": 1.0})]) == ""
