"""`make bench`'s outputs on synthetic results: the figures' math, the tables, the JSON
results, the chart, the progress plan, and vllm-router's command line and install."""

from __future__ import annotations

import math
from pathlib import Path

import orjson
import pytest

from bench import anchor, report
from bench.load import Result, merged
from bench.plots import chart
from bench.progress import shown
from bench.run import Options, outputs, parser, planned
from bench.scenarios import SCENARIOS, anchor_verdict, figures, selected
from bench.variants import variant, variant_columns

A, A_CHAT, B, B_CHAT, C, D = SCENARIOS


def result(ttft_ms: list[float], seconds: float = 1.0, errors: int = 0) -> Result:
    return Result(len(ttft_ms), errors, seconds, [t / 1000 for t in ttft_ms])


def streamed_rows() -> list[tuple[object, dict[str, float]]]:
    direct = result([1.0] * 98 + [5.0, 5.0], seconds=0.5)
    proxied = result([3.0] * 98 + [9.0, 9.0], seconds=1.0)
    router = result([2.5] * 98 + [8.5, 8.5], seconds=0.8, errors=1)
    with_anchor = figures(direct, proxied, cpu=0.2, anchor=router, anchor_cpu=0.16)
    alone = figures(direct, proxied, cpu=0.1)
    return [(B, with_anchor), (C, alone)]


def test_figures_compare_both_routers_to_the_direct_connection():
    (_, row), (_, alone) = streamed_rows()
    assert row["direct_p50"] == pytest.approx(1.0) and row["direct_p99"] == pytest.approx(5.0)
    assert row["added_p50"] == pytest.approx(2.0) and row["added_p99"] == pytest.approx(4.0)
    assert row["proxied_max"] == pytest.approx(9.0) and row["anchor_p90"] == pytest.approx(2.5)
    assert row["anchor_added_p50"] == pytest.approx(1.5)
    assert row["anchor_added_p99"] == pytest.approx(3.5)
    assert row["cpu_ms"] == pytest.approx(2.0)  # 0.2 s over 100 requests
    assert row["anchor_cpu_ms"] == pytest.approx(1.6)  # errors are not requests served
    assert row["cpu_ratio"] == pytest.approx(1.25)
    assert row["added_p50_diff"] == pytest.approx(0.5)
    assert row["added_p99_diff"] == pytest.approx(0.5)
    assert row["errors"] == 1 and row["anchor_errors"] == 1
    assert row["proxied_rps"] == 100 and row["direct_rps"] == 200
    assert not any(k.startswith("anchor_") or k == "cpu_ratio" for k in alone)


def test_rounds_merge_into_one_result():
    m = merged([result([1.0, 2.0], 1.0), result([3.0], 2.0, errors=2)])
    assert (m.requests, m.errors, m.seconds) == (3, 2, 3.0)
    assert m.ttft_p50_ms == pytest.approx(2.0) and m.rps == 1.0


def test_issue_24_targets_are_judged_on_the_named_scenarios_and_both_apis():
    (_, row), _ = streamed_rows()  # 1.25x the CPU; +0.5 ms at p50 and at p99
    p50, p99 = "added TTFT p50 ≤ vllm-router's +0.5 ms", "added TTFT p99 ≤ vllm-router's"
    for b in (B, B_CHAT):
        assert (
            anchor_verdict(b, row) == f"CPU ≤ 0.9x vllm-router: MISSED; {p50}: met; {p99}: MISSED"
        )
    cheap = {**row, "cpu_ratio": 0.9, "added_p50_diff": 0.6, "added_p99_diff": -0.1}
    assert anchor_verdict(B, cheap) == f"CPU ≤ 0.9x vllm-router: met; {p50}: MISSED; {p99}: met"
    for a in (A, A_CHAT):
        assert anchor_verdict(a, cheap) == "CPU ≤ 0.9x vllm-router: met"
        assert anchor_verdict(a, {**cheap, "cpu_ratio": 0.91}) == "CPU ≤ 0.9x vllm-router: MISSED"
    assert anchor_verdict(C, cheap) == "" and anchor_verdict(B, {"cpu_ms": 1.0}) == ""


def test_tables_state_the_ratios_directly():
    rows = streamed_rows()
    main = report.table(rows).splitlines()
    assert main[0].startswith("| scenario | req/s direct |") and "added TTFT p99" in main[0]
    assert len(main) == 4 and main[2].startswith("| (b) 64 concurrent")
    versus = report.anchor_table(rows).splitlines()
    assert len(versus) == 3  # header, rule, (b): (c) ran without the anchor
    header = [c.strip() for c in versus[0].strip("|").split("|")]
    cells = dict(zip(header, (c.strip() for c in versus[2].strip("|").split("|")), strict=True))
    assert cells["CPU pdproxy ÷ vllm-router"] == f"{rows[0][1]['cpu_ratio']:.2f}x"
    assert cells["p50 pdproxy - vllm-router"] == "+0.50 ms"
    assert cells["p99 pdproxy - vllm-router"] == "+0.50 ms"
    assert cells["CPU/request pdproxy"] == "2.000 ms"
    assert report.anchor_table(rows[1:]) == ""
    nan_row = {**rows[0][1], "cpu_ratio": math.nan}
    assert "| — |" in report.anchor_table([(B, nan_row)])


def test_variant_columns_still_join_the_main_table():
    rows = [(A, {**streamed_rows()[0][1], "cpu_plain_ms": 0.5, "cpu_other_ms": 0.55})]
    rows[0][1]["other_cost"] = 0.1
    access_log = variant("access-log")
    assert access_log is not None
    text = report.table(rows, variant_columns(access_log))
    assert "CPU/request, logs at info" in text and "+10.0%" in text


def test_the_headline_is_the_defaults_and_the_quiet_pdproxy_a_variant_beside_it():
    from bench.procs import proxy_args

    assert "--log-level" not in proxy_args(1, "http://p", "http://d")  # pdproxy's defaults
    assert parser().parse_args([]).variant == variant("quiet")
    quiet = variant("quiet")
    assert quiet is not None and quiet.args == ("--log-level", "warning")
    assert parser().parse_args(["--variant", "none"]).variant is None
    with pytest.raises(Exception, match="choose quiet"):
        variant("loud")
    columns = [title for title, _, _ in variant_columns(quiet)]
    assert columns[0] == "CPU/request, defaults" and "added TTFT p99, quiet" in columns


def test_json_results_carry_figures_machine_revision_and_load(tmp_path: Path):
    rows = streamed_rows()
    meta = report.environment(["bench.run", "--only", "b", "c"])
    meta["anchor"] = {"name": "vllm-router", "version": anchor.VERSION, "binary": "/x"}
    data = report.results(rows, report.finish(meta), quick=True, rounds=2)
    path = tmp_path / "out" / "bench.json"
    report.write_json(path, data)
    back = orjson.loads(path.read_bytes())
    assert back["schema"] == report.SCHEMA and back["quick"] is True
    assert set(back["git"]) == {"revision", "branch", "dirty"}
    assert len(back["git"]["revision"]) == 40  # the tests run in a git checkout
    assert back["machine"]["cores"] >= 1 and back["machine"]["memory_gib"] > 0
    assert len(back["load"]["before"]) == len(back["load"]["after"]) == 3
    assert back["started_at"] <= back["finished_at"]
    first = back["scenarios"][0]
    assert first["id"] == "b" and first["figures"]["cpu_ms"] == pytest.approx(2.0)
    assert first["load"]["concurrency"] == 64 and first["load"]["rounds"] == 2
    assert first["load"]["requests_per_round"] == 32 and first["load"]["engines"] == "sim"
    assert first["anchor_target"].startswith("CPU ≤ 0.9x")
    text = report.markdown(rows, back)
    assert "pdproxy beside vllm-router" in text and back["git"]["revision"][:12] in text


def test_chart_is_a_png_with_or_without_the_anchor(tmp_path: Path):
    rows = streamed_rows()
    for name, subset in (("both.png", rows), ("alone.png", rows[1:])):
        chart(tmp_path / name, subset, "title")
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_progress_plan_counts_every_request():
    plain = Options()
    assert planned(A, plain) == 2 * (200 + 32 + 4000)  # a request per worker per round
    with_anchor = Options(anchor=anchor.Anchor(Path("/x"), "v"), rounds=2)
    assert planned(A, with_anchor) == 3 * (200 + 2 * (32 + 4000))
    assert planned(D, with_anchor) == 2 * (8 + 2 * (4 + 120))  # no anchor on real engines
    quick = Options(other=variant("api-key"), quick=True)
    assert planned(C, quick) == 2 * (20 + 1 + 50) + 20 + 3 * (1 + 50)
    assert planned(B_CHAT, plain) == 2 * (200 + 64 + 640) + 640  # and the loop-lag pass
    assert shown("auto", True) and not shown("auto", False)
    assert shown("always", False) and not shown("never", True)


def test_scenarios_and_outputs_are_chosen_as_asked(tmp_path: Path):
    assert [s.letter for s in selected(["a", "c"])] == ["a", "c"]
    chat = selected(["a-chat", "b-chat"])
    got = [(s.letter, s.api, s.phases) for s in chat]
    assert got == [("a-chat", "chat", False), ("b-chat", "chat", True)]
    assert (A_CHAT.concurrency, A_CHAT.max_tokens, B_CHAT.decode_tps) == (32, 16, 200)
    assert len(selected(None)) == len(SCENARIOS)
    default = outputs(None, None, "20261201T000000Z")
    assert default.json.name == "bench-20261201T000000Z.json"
    assert default.plot is not None and default.plot.suffix == ".png"
    assert default.markdown.suffix == ".md"
    chosen = outputs(tmp_path / "r.json", "none", "t")
    assert chosen.json == tmp_path / "r.json" and chosen.plot is None


def test_anchor_command_line_runs_pd_mode_on_the_given_ports():
    a = anchor.Anchor(Path("/venv/bin/vllm-router"), "0.1.17")
    assert a.command(30001, "http://127.0.0.1:1", "http://127.0.0.1:2", 30002) == [
        "/venv/bin/vllm-router",
        *("--host", "127.0.0.1", "--port", "30001"),
        "--vllm-pd-disaggregation",
        *("--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"),
        *("--policy", "round_robin", "--kv-connector", "nixl"),
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", "30002"),
        *("--worker-startup-check-interval", "1", "--log-level", "warning"),
    ]


def test_anchor_on_its_defaults_names_no_policy_and_no_log_level():
    a = anchor.Anchor(Path("/venv/bin/vllm-router"), "0.1.17", defaults=True)
    args = a.command(30001, "http://127.0.0.1:1", "http://127.0.0.1:2", 30002)
    assert "--policy" not in args and "--log-level" not in args
    assert args[-2:] == ["--worker-startup-check-interval", "1"]
    assert "--prometheus-port" in args and "--vllm-pd-disaggregation" in args


def test_anchor_fleet_command_lists_every_engine_and_the_policy():
    a = anchor.Anchor(Path("/venv/bin/vllm-router"), "0.1.17")
    args = a.fleet_command(1, ["http://p:1", "http://p:2"], ["http://d:1"], 2, "cache_aware")
    joined = " ".join(args)
    assert "--prefill http://p:1 --prefill http://p:2 --decode http://d:1" in joined
    assert "--policy cache_aware" in joined and "--vllm-pd-disaggregation" in args


def test_anchor_installs_once_into_its_own_venv(tmp_path: Path):
    venv = tmp_path / "vllm-router-venv"
    calls: list[list[str]] = []

    def fake_pip(args: list[str]) -> None:
        calls.append(args)
        if args[1:3] == ["-m", "venv"]:
            (venv / "bin").mkdir(parents=True)
            (venv / "bin" / "vllm-router").write_text("")

    got = anchor.ensure(venv, "0.1.17", run=fake_pip)
    assert got == anchor.Anchor(venv / "bin" / "vllm-router", "0.1.17")
    assert calls[-1][-1] == "vllm-router==0.1.17" and str(venv) in calls[0]
    assert (venv / anchor.STAMP).read_text().strip() == "0.1.17"
    n = len(calls)
    assert anchor.ensure(venv, "0.1.17", run=fake_pip) == got and len(calls) == n  # stamped
    anchor.ensure(venv, "0.1.18", run=fake_pip)  # another version: installed afresh
    assert calls[-1][-1] == "vllm-router==0.1.18" and len(calls) == 2 * n


def test_an_install_that_leaves_no_binary_fails_loudly(tmp_path: Path):
    with pytest.raises(RuntimeError, match="did not install"):
        anchor.ensure(tmp_path / "v", "0.1.17", run=lambda args: None)


def test_rounds_must_be_at_least_one(capsys: pytest.CaptureFixture[str]):
    assert parser().parse_args(["--rounds", "3", "--only", "a", "c"]).rounds == 3
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit):
            parser().parse_args(["--rounds", bad])
    assert "whole number" in capsys.readouterr().err
