"""``make bench-workers`` end to end in a second (its figures are the benchmark's business,
not a test's): both variants run, every request is answered, the table and the verdict
print; the null engine answers what pdproxy asks of an engine."""

from __future__ import annotations

import subprocess
import sys

import orjson

from bench.workers import Round, table, verdicts


def test_bench_workers_runs_both_variants(tmp_path):
    out = tmp_path / "rounds.json"
    args = [sys.executable, "-m", "bench.workers", "--seconds", "0.5", "--warmup", "0.2"]
    args += ["--rounds", "1", "--connections", "8", "--json", str(out)]
    args += ["--logdir", str(tmp_path / "logs")]
    run = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert run.returncode in (0, 1), run.stderr[-2000:]  # 1: the targets missed, on a busy box
    rounds = orjson.loads(out.read_bytes())
    assert sorted(r["workers"] for r in rounds) == [1, 2]
    assert all(r["requests"] > 0 and r["errors"] == 0 for r in rounds)
    assert all(r["proxy_cpu"] > 0 for r in rounds)
    assert "| workers | req/s (best)" in run.stdout
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
