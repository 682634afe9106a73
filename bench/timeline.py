"""Where a request's time goes through pdproxy under load: a per-phase timeline.

    python -m bench.timeline [--case stream|short] [--api completions|chat] [--proxy-args "..."]

Runs a 1P1D sim fleet and pdproxy on its default flags (its access line on, text logs to a
file) plus ``--proxy-args``, drives the case's load with a client that names each request
with ``X-Request-Id`` and stamps its TTFT, and joins those stamps with pdproxy's access line
for the same request (``bench.phases``: the phases and how each is derived). Prints each
phase's p50, p90 and p99 over the requests. ``make bench`` prints the same breakdown for
scenario (b) from its own measured rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import tempfile
from pathlib import Path

from bench import load, phases
from bench.procs import process, proxy_args, sim_args, wait_healthy
from engines.ports import free_ports

CASES = {"stream": (64, 128, 200.0, 1280), "short": (32, 16, 0.0, 4000)}


def table(samples: dict[str, list[float]]) -> str:
    n = len(samples["ttfb"])
    lines = [f"{n} requests joined with their access lines", "| phase | p50 | p90 | p99 |"]
    lines.append("|---|---|---|---|")
    for key, title in phases.PHASES:
        p50, p90, p99 = (phases.quantile(samples[key], q) for q in (0.5, 0.9, 0.99))
        lines.append(f"| {title} | {p50:.2f} ms | {p90:.2f} ms | {p99:.2f} ms |")
    return "\n".join(lines)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=sorted(CASES), default="stream")
    parser.add_argument("--api", choices=sorted(load.APIS), default="completions")
    parser.add_argument("--proxy-args", default="", help="more pdproxy flags")
    args = parser.parse_args()
    concurrency, max_tokens, tps, total = CASES[args.case]
    p, d, x = free_ports(3)
    p_url, d_url, x_url = (f"http://127.0.0.1:{port}" for port in (p, d, x))
    with tempfile.TemporaryDirectory() as logdir, contextlib.ExitStack() as stack:
        stack.enter_context(process(sim_args(p, "prefill", tps), f"{logdir}/p.log"))
        stack.enter_context(process(sim_args(d, "decode", tps), f"{logdir}/d.log"))
        flags = shlex.split(args.proxy_args)
        stack.enter_context(process(proxy_args(x, p_url, d_url, *flags), f"{logdir}/x.log"))
        for url in (p_url, d_url, x_url):
            await wait_healthy(url)
        stamps: dict[str, float] = {}
        for n, kept in ((400, None), (total, stamps)):  # a warm-up, then the measured run
            await load.run(
                x_url,
                total=n,
                concurrency=concurrency,
                max_tokens=max_tokens,
                api=args.api,
                stamps=kept,
            )
        await asyncio.sleep(0.5)  # the last access lines
        text = await asyncio.to_thread(Path(f"{logdir}/x.log").read_text, errors="replace")
        print(table(phases.samples(stamps, phases.access_lines(text.splitlines()))))


if __name__ == "__main__":
    asyncio.run(main())
