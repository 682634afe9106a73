"""`make bench-flow`'s scenarios (issue 31's acceptance) on a loopback 1P1D sim fleet, short:
each target holds with flow control on, and the same run with it off shows what it fixes."""

from __future__ import annotations

from pathlib import Path

from bench.flow import run, targets


async def test_every_flow_control_target_holds_and_fifo_misses_them(tmp_path: Path):
    results = await run(str(tmp_path), 4.0)
    checks = targets(results)
    assert all(checks.values()), checks
    off = {f.scenario: f.figures for f in results if f.column == "off"}
    on = {f.scenario: f.figures for f in results if f.column == "on"}
    # first come, first served: the interactive tenant waits behind the batch flood...
    assert off["priority"]["interactive_p99_over_alone"] > 3
    # ...the steady tenant behind the flooder, the weights mean nothing...
    assert off["fairness"]["steady_over_owed"] < 0.8
    assert off["fairness"]["weighted_ratio"] < 2.0
    # ...requests with a deadline wait behind the whole queue, and nothing is metered
    assert (off["deadlines"]["deadline_admitted"] or 0) < on["deadlines"]["deadline_admitted"]
    assert off["limits"]["metered_refused"] == 0
    assert on["deadlines"]["prediction_samples"] > 0
