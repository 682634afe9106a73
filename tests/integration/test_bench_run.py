"""`make bench` end to end, small: `bench.run --quick` on scenario (c) starts the sims and
pdproxy as processes, measures, and writes its JSON, Markdown and PNG; with vllm-router
installed (`make bench ANCHOR=vllm-router` installs it), the same beside the anchor. On
(b-chat), pdproxy on its defaults beside a quiet one, traced by phase, its loop's lag."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from bench import anchor

ROOT = Path(__file__).resolve().parents[2]


def bench(tmp_path: Path, *args: str, only: str = "c") -> tuple[str, dict]:
    out = tmp_path / "r.json"
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--only", only, "--quick", "--json", str(out), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "it/s" not in done.stderr and "req/s]" not in done.stderr  # no bar when not a TTY
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert out.with_suffix(".md").read_text().strip() in done.stdout
    return done.stdout, orjson.loads(out.read_bytes())


def test_quick_run_writes_every_output(tmp_path: Path):
    stdout, data = bench(tmp_path)
    assert "| (c) one at a time, 16 tokens |" in stdout and "pdproxy beside" not in stdout
    (c,) = data["scenarios"]
    assert c["id"] == "c" and c["load"]["requests_per_round"] == 50
    f = c["figures"]
    assert f["errors"] == 0 and f["proxied_requests"] == f["direct_requests"] == 50
    assert 0 < f["direct_p50"] < f["proxied_p50"] and f["cpu_ms"] > 0
    assert data["anchor"] is None and data["quick"] is True
    assert data["variant"] == "quiet" and f["cpu_other_ms"] > 0  # the quiet pdproxy beside
    assert "phase_requests" not in f and "loop_lag_p99" not in f  # traced under (b) only


def test_quick_streaming_chat_run_traces_the_default_pdproxy_by_phase(tmp_path: Path):
    logs = tmp_path / "logs"
    stdout, data = bench(tmp_path, "--logdir", str(logs), only="b-chat")
    (b,) = data["scenarios"]
    assert b["id"] == "b-chat" and b["load"]["api"] == "chat"
    f = b["figures"]
    assert f["errors"] == 0 and f["proxied_requests"] == 32
    assert f["phase_requests"] == 32  # every measured request joined with its access line
    assert 0 < f["phase_prefill_p50"] <= f["phase_ttfb_p50"] < f["phase_client_ttft_p50"]
    assert f["phase_decode_headers_p50"] > 0 and f["phase_to_prefill_p50"] >= 0
    assert f["loop_probes"] > 10 and 0 <= f["loop_lag_p50"] <= f["loop_lag_p99"]
    assert f["cpu_plain_ms"] > 0 and f["cpu_other_ms"] > 0 and "other_added_p50" in f
    assert "| arrival → prefill sent |" in stdout and "event-loop lag" in stdout
    assert "added TTFT p50, quiet" in stdout
    log = (logs / "x.log").read_text()  # the defaults: logs at info, the access line
    assert "pdproxy.access: request finished endpoint=/v1/chat/completions" in log


@pytest.mark.skipif(
    anchor.installed() is None,
    reason=f"vllm-router {anchor.VERSION} is not in {anchor.VENV} (make bench ANCHOR=vllm-router)",
)
def test_quick_run_beside_vllm_router(tmp_path: Path):
    stdout, data = bench(tmp_path, "--anchor", "vllm-router", "--rounds", "2")
    assert "pdproxy beside vllm-router" in stdout
    f = data["scenarios"][0]["figures"]
    assert f["anchor_errors"] == 0 and f["anchor_requests"] == 100  # 2 rounds of 50
    assert f["anchor_cpu_ms"] > 0 and f["anchor_p50"] > f["direct_p50"]
    assert f["cpu_ratio"] == pytest.approx(f["cpu_ms"] / f["anchor_cpu_ms"])
    assert data["anchor"]["version"] == anchor.VERSION


def test_cpu_counts_the_descendants_of_a_router(tmp_path: Path):
    """A `--workers N` pdproxy's CPU is in its workers: the bench sums the process tree."""
    from bench.procs import cpu_seconds, process, tree_cpu_seconds

    burn = (
        "import time\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < 0.3: pass\n"
        "time.sleep(30)\n"
    )
    child = f"{sys.executable} -c '{burn}' & wait"
    with process(["bash", "-c", child], str(tmp_path / "log")) as parent:
        deadline = time.monotonic() + 20
        while tree_cpu_seconds(parent.pid) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tree_cpu_seconds(parent.pid) >= 0.25
        assert cpu_seconds(parent.pid) < 0.1


async def test_a_server_that_never_answers_is_reported_with_its_log(tmp_path: Path):
    from bench.run import _healthy
    from engines.ports import free_port

    log = tmp_path / "r.log"
    log.write_text("starting\nerror: address already in use\n")
    with pytest.raises(RuntimeError, match="address already in use"):
        await _healthy(f"http://127.0.0.1:{free_port()}", str(log), timeout=0.3)
