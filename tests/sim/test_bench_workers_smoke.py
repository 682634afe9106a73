"""``make bench-workers`` end to end in a second (its figures are the benchmark's business,
not a test's): both variants and the engines-alone baseline run, every request and every
stream is answered, the tables and the verdict print; the null engine answers what pdproxy
asks of an engine, whole and streamed."""

from __future__ import annotations

import subprocess
import sys

import orjson

from bench.workers import Round, cost_table, table, verdicts


def test_bench_workers_runs_both_variants(tmp_path):
    out = tmp_path / "rounds.json"
    args = [sys.executable, "-m", "bench.workers", "--seconds", "0.5", "--warmup", "0.2"]
    args += ["--rounds", "1", "--connections", "8", "--json", str(out)]
    args += ["--streams", "4", "--stream-tokens", "4", "--tps", "100"]
    args += ["--logdir", str(tmp_path / "logs")]
    run = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert run.returncode in (0, 1), run.stderr[-2000:]  # 1: the targets missed, on a busy box
    rounds = orjson.loads(out.read_bytes())
    assert sorted(r["workers"] for r in rounds) == [0, 1, 2]  # 0: the engines alone
    assert all(r["requests"] > 0 and r["errors"] == 0 for r in rounds)
    assert all(r["streams"] > 0 and r["stream_errors"] == 0 for r in rounds)
    assert all(0 < r["ttft_p50"] <= r["ttft_p99"] < 1 for r in rounds)
    proxied = [r for r in rounds if r["workers"]]
    assert all(r["proxy_cpu"] > 0 and r["stream_cpu"] > 0 and r["pss_bytes"] > 0 for r in proxied)
    assert "| workers | req/s (best)" in run.stdout
    assert "| workers | CPU/request, short" in run.stdout
    assert ("PASS:" in run.stdout) == (run.returncode == 0)


def test_the_verdict_needs_both_more_cores_and_more_requests():
    one = Round(1, requests=1000, errors=0, seconds=1, proxy_cpu=0.9, sims_cpu=0, client_cpu=0)
    two = Round(2, requests=1800, errors=0, seconds=1, proxy_cpu=1.5, sims_cpu=0, client_cpu=0)
    assert verdicts([one, two]) == []
    slow = Round(2, requests=900, errors=0, seconds=1, proxy_cpu=1.5, sims_cpu=0, client_cpu=0)
    assert len(verdicts([one, slow])) == 1
    idle = Round(2, requests=1800, errors=0, seconds=1, proxy_cpu=1.1, sims_cpu=0, client_cpu=0)
    assert "1.10 cores" in verdicts([one, idle])[0]
    assert "| 2 | 1,800 | 1,800 | 1.50 | 0.833 ms |" in table([one, two])


def test_the_cost_table_adds_ttft_over_the_engines_alone():
    def at(workers, ttft, cpu, rss):
        return Round(
            workers,
            requests=1000,
            errors=0,
            seconds=1,
            proxy_cpu=cpu,
            sims_cpu=0,
            client_cpu=0,
            latency_p50=0.004,
            latency_p99=0.010,
            streams=100,
            stream_seconds=1,
            stream_cpu=cpu,
            ttft_p50=ttft,
            ttft_p99=2 * ttft,
            rss_bytes=rss,
            pss_bytes=rss // 2,
        )

    rounds = [at(0, 0.001, 0.0, 0), at(1, 0.004, 0.5, 64 << 20), at(2, 0.006, 0.6, 192 << 20)]
    text = cost_table(rounds)
    assert "| 1 | 0.500 ms | 5.00 ms | 4.0 / 10.0 ms | 4.0 / 8.0 ms | +3.0 / +6.0 ms" in text
    assert "| 2 | 0.600 ms | 6.00 ms | 4.0 / 10.0 ms | 6.0 / 12.0 ms | +5.0 / +10.0 ms" in text
    assert "| 192 MiB (96 MiB) |" in text
    assert "| 0 |" not in text  # the baseline is the reference, not a row
