"""`make bench`: direct-to-decode vs through pdproxy against sim engines, in one run.

Scenarios (issue 3): (a) 32 concurrent streams of 16 tokens as fast as possible, (b) 64
concurrent streams of 128 tokens at 200 tokens/s each, (c) one request at a time, (d) real
vLLM engines; (a-chat) and (b-chat) are (a) and (b) on /v1/chat/completions (issue 24). For
each: requests/s, TTFT p50/p99 direct and proxied, the TTFT pdproxy adds, and pdproxy's own
CPU time per request (from /proc). pdproxy runs on its default flags (its logs, access line
included, to a file); a second pdproxy, quiet (logs at warning) unless ``--variant`` says
otherwise, is measured alternately beside it. With ``--anchor vllm-router``, the Rust router
measured alike in front of the same sims, interleaved with pdproxy (issue 12). Under (b),
pdproxy's TTFT by phase, from its access lines, and its event loop's lag (``bench.phases``,
``bench.loop_probe``).

Prints Markdown tables, writes every figure with the machine, the git revision and the load
to a JSON file and draws a PNG chart (bench/results/bench-<time>.{json,md,png} by default).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import os
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import anchor as anchors
from bench import load, phases, report
from bench.deployment import Deployment, Route
from bench.loop_probe import lag, probing
from bench.procs import process, proxy_args, sim_args, tree_cpu_seconds, wait_healthy
from bench.progress import MODES, Progress
from bench.scenarios import Scenario, figures, selected
from bench.variants import BENCH_KEY, Variant, alternate, variant, variant_columns
from engines.ports import free_port, free_ports

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Options:
    names: list[str] | None = None
    other: Variant | None = None
    anchor: anchors.Anchor | None = None
    rounds: int = 1
    quick: bool = False
    logdir: Path | None = None  # keep the servers' logs there (else a temporary directory)


@contextlib.asynccontextmanager
async def sim_deployment(
    decode_tps: float,
    logdir: str,
    other: Variant | None = None,
    anchor: anchors.Anchor | None = None,
) -> AsyncIterator[Deployment]:
    """One prefill sim, one decode sim and pdproxy, each its own process; with ``other``,
    a second pdproxy in front of the same sims, configured as it says; with ``anchor``,
    vllm-router in front of them too."""
    p_port, d_port, x_port, k_port, r_port, m_port = free_ports(6)
    p_url, d_url, x_url, k_url, r_url = (
        f"http://127.0.0.1:{p}" for p in (p_port, d_port, x_port, k_port, r_port)
    )
    with contextlib.ExitStack() as stack:
        stack.enter_context(process(sim_args(p_port, "prefill", decode_tps), f"{logdir}/p.log"))
        stack.enter_context(process(sim_args(d_port, "decode", decode_tps), f"{logdir}/d.log"))
        proxy = stack.enter_context(process(proxy_args(x_port, p_url, d_url), f"{logdir}/x.log"))
        urls = [(p_url, "p"), (d_url, "d"), (x_url, "x")]
        other_pid = anchor_pid = 0
        if other is not None:
            await asyncio.to_thread(Path(f"{logdir}/client.key").write_text, BENCH_KEY)
            args = other.command(k_port, p_url, d_url, logdir)
            other_pid = stack.enter_context(process(args, f"{logdir}/k.log")).pid
            urls.append((k_url, "k"))
        for url, name in urls:
            await _healthy(url, f"{logdir}/{name}.log")
        if anchor is not None:  # after the sims answer: it checks them once as it starts
            args = anchor.command(r_port, p_url, d_url, m_port)
            anchor_pid = stack.enter_context(process(args, f"{logdir}/r.log")).pid
            await _healthy(r_url, f"{logdir}/r.log")
        yield Deployment(
            d_url,
            x_url,
            proxy.pid,
            "sim-model",
            k_url if other else None,
            other_pid,
            r_url if anchor else None,
            anchor_pid,
        )


async def _healthy(url: str, log: str, timeout: float = 30.0) -> None:
    """Wait for ``url``'s /health; if it never answers, say why with its log's last lines."""
    try:
        await wait_healthy(url, timeout)
    except RuntimeError as e:
        text = await asyncio.to_thread(Path(log).read_text, errors="replace")
        tail = "\n".join(text.splitlines()[-20:])
        raise RuntimeError(f"{e}; the end of its log, {log}:\n{tail}") from None


@contextlib.asynccontextmanager
async def real_deployment(logdir: str) -> AsyncIterator[Deployment]:
    """A real vLLM CPU prefill and decode (NIXL) and pdproxy; "direct" is the decode alone."""
    from engines.vllm.launch import vllm_engines

    with vllm_engines(connector="nixl") as pair:
        x_port = free_port()
        x_url = f"http://127.0.0.1:{x_port}"
        with process(
            proxy_args(x_port, pair.prefill_url, pair.decode_url), f"{logdir}/proxy.log"
        ) as proxy:
            await wait_healthy(x_url)
            yield Deployment(pair.decode_url, x_url, proxy.pid, pair.model)


def planned(scenario: Scenario, opts: Options) -> int:
    """Requests the scenario will send, for the progress bar."""
    warmup, total = scenario.sizes(opts.quick)
    paths = 2 + (opts.anchor is not None and not scenario.real)
    n = paths * (warmup + opts.rounds * (scenario.concurrency + total))
    if opts.other is not None and not scenario.real:
        n += warmup + 3 * (scenario.concurrency + total)
    if scenario.phases and not scenario.real:
        n += total  # the pass the loop's lag is measured over
    return n


async def measure(
    scenario: Scenario, logdir: str, opts: Options, progress: Progress
) -> dict[str, float]:
    deployment = (
        real_deployment(logdir)
        if scenario.real
        else sim_deployment(scenario.decode_tps, logdir, opts.other, opts.anchor)
    )
    progress.stage(f"({scenario.letter}) starting")
    async with deployment as d, contextlib.AsyncExitStack() as stack:
        warm: dict[str, Any] = dict(
            concurrency=scenario.concurrency,
            max_tokens=scenario.max_tokens,
            model=d.model,
            unique_prompts=scenario.real,
            on_done=progress.advance,
            api=scenario.api,
        )
        warmup, total = scenario.sizes(opts.quick)
        paths = d.paths()
        sessions = {p.name: await stack.enter_async_context(load.client()) for p in paths}
        for p in paths:
            progress.stage(f"({scenario.letter}) warm-up, {p.name}")
            await load.run(p.url, total=warmup, session=sessions[p.name], **warm)
        stamps: dict[str, float] | None = {} if scenario.phases else None
        results, cpu = await _rounds(
            scenario, paths, opts.rounds, total, warm, sessions, progress, stamps
        )
        row = figures(
            load.merged(results["direct"]),
            load.merged(results["pdproxy"]),
            cpu["pdproxy"],
            load.merged(results["vllm-router"]) if "vllm-router" in results else None,
            cpu.get("vllm-router", 0.0),
        )
        n = int(row["proxied_requests"])
        if stamps is not None:
            row.update(await _traced(stamps, f"{logdir}/x.log"))
            progress.stage(f"({scenario.letter}) event-loop lag, pdproxy")
            row.update(await _loop_lag(d.proxy_url, total, warm, sessions["pdproxy"]))
        if opts.other is not None:
            progress.stage(f"({scenario.letter}) {opts.other.title}")
        direct = load.merged(results["direct"])
        plain = sessions["pdproxy"]
        row.update(
            await alternate(d, opts.other, total, warm, warmup, n, cpu["pdproxy"], direct, plain)
        )
    return row


async def _traced(stamps: dict[str, float], log: str) -> dict[str, float]:
    """pdproxy's TTFT by phase over its measured requests: the client's stamps joined with
    pdproxy's access lines in its log."""
    await asyncio.sleep(0.2)  # the last request's line is written after its last byte
    text = await asyncio.to_thread(Path(log).read_text, errors="replace")
    return phases.figures(phases.samples(stamps, phases.access_lines(text.splitlines())))


async def _loop_lag(url: str, total: int, warm: dict[str, Any], session: Any) -> dict[str, float]:
    """pdproxy's event-loop lag under the scenario's load, in a pass of its own (the probe's
    requests stay out of the measured CPU): a second of the probe alone, then the load."""
    async with probing(url) as samples:
        await asyncio.sleep(1.0)
        start = time.monotonic()
        await load.run(url, total=total, session=session, **warm)
        end = time.monotonic()
    return lag(samples, start, end)


async def _rounds(
    scenario: Scenario,
    paths: Sequence[Route],
    rounds: int,
    total: int,
    warm: dict[str, Any],
    sessions: dict[str, Any],
    progress: Progress,
    stamps: dict[str, float] | None = None,
) -> tuple[dict[str, list[load.Result]], dict[str, float]]:
    """``rounds`` of the load through every path, the order reversed every other round
    (direct, pdproxy, vllm-router; then back), so no path always runs in the same slot
    of whatever else the machine is doing. Returns each path's results and CPU seconds.

    Each path's client keeps its connections open across the scenario, and one request
    per worker before each round (not measured) makes sure they are: a round measures the
    routers' steady state, not a storm of new connections at its start (that one server
    closed while idle, the other not). With ``stamps``, pdproxy's measured requests carry
    their ids and their TTFTs are recorded there."""
    results: dict[str, list[load.Result]] = {p.name: [] for p in paths}
    cpu = {p.name: 0.0 for p in paths}
    for r in range(rounds):
        for p in paths if r % 2 == 0 else reversed(paths):
            progress.stage(f"({scenario.letter}) round {r + 1}/{rounds}, {p.name}")
            session = sessions[p.name]
            await load.run(p.url, total=scenario.concurrency, session=session, **warm)
            before = tree_cpu_seconds(p.pid) if p.pid else 0.0
            kept = stamps if p.name == "pdproxy" else None
            result = await load.run(p.url, total=total, session=session, stamps=kept, **warm)
            results[p.name].append(result)
            cpu[p.name] += tree_cpu_seconds(p.pid) - before if p.pid else 0.0
    return results, cpu


@dataclass(frozen=True)
class Outputs:
    json: Path
    markdown: Path
    plot: Path | None


def outputs(json_path: Path | None, plot: str | None, stamp: str) -> Outputs:
    """Where the results go: ``--json PATH`` (the Markdown beside it, ``.md``), ``--plot
    PATH`` or ``none``; by default bench/results/bench-<stamp>.*"""
    base = RESULTS / f"bench-{stamp}.json"
    j = json_path or base
    png = None if plot == "none" else Path(plot) if plot else j.with_suffix(".png")
    return Outputs(j, j.with_suffix(".md"), png)


async def run_all(opts: Options, progress: Progress) -> list[tuple[Scenario, dict[str, float]]]:
    rows = []
    if opts.logdir is not None:
        opts.logdir.mkdir(parents=True, exist_ok=True)
    kept = contextlib.nullcontext(str(opts.logdir)) if opts.logdir is not None else None
    with kept or tempfile.TemporaryDirectory(prefix="pdproxy-bench-") as logdir:
        for scenario in selected(opts.names):
            before = os.getloadavg()[0]
            row = await measure(scenario, logdir, opts, progress)
            row.update(load_1m_before=before, load_1m_after=os.getloadavg()[0])
            rows.append((scenario, row))
            progress.note(f"done: {scenario.name}")
    return rows


async def main_async(opts: Options, out: Outputs, progress_mode: Any) -> None:
    meta = report.environment(sys.argv)
    meta["anchor"] = (
        {
            "name": anchors.NAME,
            "version": opts.anchor.version,
            "binary": str(opts.anchor.binary),
            "flags": "its defaults" if opts.anchor.defaults else "round_robin, warning",
        }
        if opts.anchor is not None
        else None
    )
    meta["variant"] = opts.other.title if opts.other is not None else None
    progress = Progress(sum(planned(s, opts) for s in selected(opts.names)), progress_mode)
    try:
        rows = await run_all(opts, progress)
    finally:
        progress.close()
    meta = report.finish(meta)
    extra = variant_columns(opts.other) if opts.other is not None else ()
    text = report.markdown(rows, meta, extra)
    print("\n" + text)
    report.write_json(out.json, report.results(rows, meta, opts.quick, opts.rounds))
    out.markdown.write_text(text + "\n")
    written = [out.json, out.markdown]
    if out.plot is not None and rows:
        from bench.plots import chart

        chart(out.plot, rows, report.subtitle(meta))
        written.append(out.plot)
    print("\nwritten: " + ", ".join(str(p) for p in written))


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"a whole number ≥ 1, not {text!r}")
    return int(text)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", help="scenario ids to run, e.g. a b-chat c")
    p.add_argument(
        "--variant",
        type=variant,
        default="quiet",
        help="Also run each simulated scenario through a second pdproxy, alternating with "
        "the headline one (pdproxy's defaults) in the same run, and report its CPU per "
        "request and added TTFT: quiet (logs at warning, the default), api-key (checks a "
        "client key), access-log, flags=FLAGS, rev=REV (the code of git revision REV, for a "
        "before/after in one run), none (no second pdproxy).",
    )
    p.add_argument(
        "--api-key", action="store_true", help="Same as --variant api-key (kept for scripts)."
    )
    p.add_argument(
        "--anchor",
        choices=[anchors.NAME],
        help="Also measure vllm-router (PD mode, round robin) in front of the same sims, "
        f"interleaved with pdproxy; installs it into {anchors.VENV} on first use.",
    )
    p.add_argument(
        "--anchor-defaults",
        action="store_true",
        help="vllm-router on its own defaults (cache_aware, logs at info), as users run it, "
        "instead of its cheapest configuration (round robin, logs at warning)",
    )
    p.add_argument("--anchor-version", default=anchors.VERSION, help="vllm-router's version")
    p.add_argument("--anchor-venv", type=Path, default=anchors.VENV, help="its own venv")
    p.add_argument(
        "--rounds",
        type=_positive,
        default=None,
        help="measured rounds per path, the order reversed every other round "
        "(default 4 with --anchor, else 1)",
    )
    p.add_argument("--quick", action="store_true", help="a twentieth of the requests (smoke)")
    p.add_argument("--json", type=Path, help="the JSON results' path (the .md goes beside it)")
    p.add_argument("--plot", help="the PNG chart's path, or 'none' (default: beside the JSON)")
    p.add_argument("--progress", choices=MODES, default="auto", help="the bar on stderr")
    p.add_argument("--logdir", type=Path, help="keep the servers' logs here (one set per run)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    import uvloop

    other = variant("api-key") if args.api_key else args.variant
    anchor = anchors.ensure(args.anchor_venv, args.anchor_version) if args.anchor else None
    if anchor is not None and args.anchor_defaults:
        anchor = dataclasses.replace(anchor, defaults=True)
    rounds = args.rounds or (4 if anchor is not None else 1)
    opts = Options(args.only, other, anchor, rounds, args.quick, args.logdir)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    uvloop.run(main_async(opts, outputs(args.json, args.plot, stamp), args.progress))


if __name__ == "__main__":
    main()
