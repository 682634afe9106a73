"""NIXL push on the real CPU tier: both legs at once (``--push-dispatch concurrent``) against
the prefill first (``--push-dispatch serial``, the pull-like hand-over), on the same push pair
in the same run.

A real vLLM CPU ``NixlPushConnector`` pair (SmolLM2-135M-Instruct) behind two pdproxy
processes on their default flags, one per dispatch. Each request goes to both, interleaved
(the order alternating), greedy and streamed. Two cases per prompt size: ``cold`` (a fresh
``cache_salt``: neither engine holds the prompt, as for a new conversation) and ``warm`` (a
prompt whose first nine tenths the decode already holds: the next turn of a conversation,
where vLLM measured push's gains). Reported: the client's first token p50 and p90 per
dispatch, and the machine's load (1-minute load average, cores) around the run, since the
decode's busy wait for its write shares the prefill's cores on one machine.

    make bench-push PUSH_ARGS="--requests 20 --sizes 100,1000"

Needs the real-engine venv and model (``make engines-venv engines-smollm2``); it starts and
stops the engines itself, or uses a running push pair (``--prefill URL --decode URL``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from bench.first_token import timings
from bench.procs import process, proxy_args, wait_healthy
from bench.render_once import prompt
from engines.ports import free_port
from engines.vllm.launch import SMOLLM2, vllm_engines

COMPLETIONS = "/v1/completions"
VARIANTS = ("serial", "concurrent")
CASES = ("cold", "warm")


def body(text: str, salt: str | None, tokens: int = 8) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": SMOLLM2,
        "prompt": text,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
    }
    if salt is not None:
        out["cache_salt"] = salt
    return out


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(urls: dict[str, str], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    async with aiohttp.ClientSession() as session:
        for v in VARIANTS:  # each proxy learns the prefill's NIXL side from a serial answer
            for _ in range(2):
                await timings(session, urls[v] + COMPLETIONS, body(prompt(32), uuid.uuid4().hex))
        for size in args.sizes:
            for case in CASES:
                first: dict[str, list[float]] = {v: [] for v in VARIANTS}
                load_before = os.getloadavg()[0]
                for i in range(args.requests):
                    for v in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
                        if case == "cold":
                            payload = body(prompt(size), uuid.uuid4().hex)
                        else:
                            # the same conversation so far, one new turn: the decode holds
                            # its first nine tenths from the previous request
                            shared = prompt(size * 9 // 10)
                            payload = body(f"{shared} turn {i} {v}", f"{v}-conversation")
                        t1, _ = await timings(session, urls[v] + COMPLETIONS, payload)
                        first[v].append(t1 * 1000)
                row: dict[str, Any] = {
                    "prompt_tokens": size,
                    "case": case,
                    "load_before": round(load_before, 2),
                    "load_after": round(os.getloadavg()[0], 2),
                    "cores": os.cpu_count(),
                }
                for v in VARIANTS:
                    row[f"ttft_p50_{v}"] = statistics.median(first[v])
                    row[f"ttft_p90_{v}"] = quantile(first[v], 0.9)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


@contextlib.contextmanager
def proxies(prefill: str, decode: str, run_dir: Path) -> Iterator[dict[str, str]]:
    ports = {v: free_port() for v in VARIANTS}
    with contextlib.ExitStack() as stack:
        for v in VARIANTS:
            argv = proxy_args(
                ports[v], prefill, decode, "--kv-connector", "nixl-push", "--push-dispatch", v
            )
            stack.enter_context(process(argv, str(run_dir / f"pdproxy-{v}.log")))
        urls = {v: f"http://127.0.0.1:{ports[v]}" for v in VARIANTS}
        for url in urls.values():
            asyncio.run(wait_healthy(url))
        yield urls


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| prompt | case | TTFT p50 serial / concurrent | TTFT p90 serial / concurrent"
        " | load avg before → after (cores) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| ~{r['prompt_tokens']} tokens | {r['case']}"
            f" | {r['ttft_p50_serial']:.1f} / {r['ttft_p50_concurrent']:.1f} ms"
            f" | {r['ttft_p90_serial']:.1f} / {r['ttft_p90_concurrent']:.1f} ms"
            f" | {r['load_before']} → {r['load_after']} ({r['cores']}) |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[100, 1000])
    p.add_argument("--prefill", default=None)
    p.add_argument("--decode", default=None)
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        if args.prefill and args.decode:
            prefill, decode = args.prefill, args.decode
        else:
            pair = stack.enter_context(
                vllm_engines(connector="nixl-push", model=SMOLLM2, max_model_len=2560)
            )
            prefill, decode = pair.prefill_url, pair.decode_url
        run_dir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        urls = stack.enter_context(proxies(prefill, decode, run_dir))
        rows = asyncio.run(measure(urls, args))
    print(table(rows))
    print(f"({time.monotonic() - started:.0f} s in all)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
