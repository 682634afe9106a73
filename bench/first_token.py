"""What ``--first-token-from-prefill`` saves on the real CPU tier: the client's first token
with and without it, in the same run.

A real vLLM CPU NIXL pair (SmolLM2-135M-Instruct, ``--enable-scale-out``) behind two pdproxy
processes, both with ``--render-once``: one as it is, one with ``--first-token-from-prefill``.
Each request goes to both, interleaved (the order alternating), greedy, streamed, with a
fresh ``cache_salt`` (every prefill cold). Reported per prompt size and endpoint: the first
token's p50 and p99 (the client's first chunk with a token), the second token's p50 (it must
be no later), and per phase as each proxy measured it (its /metrics): the prefill leg, and
the decode's first bytes after the prefill answered (the KV pull and the decode's first
step, which the flag takes off the client's wait).

    make bench-first-token FIRST_TOKEN_ARGS="--requests 20 --sizes 100,1000"

Needs the real-engine venv and model (``make engines-venv engines-smollm2``); it starts
and stops the engines itself, or uses a running pair (``--prefill URL --decode URL``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from bench.procs import process, proxy_args, wait_healthy
from bench.render_once import prompt
from engines.ports import free_port
from engines.vllm.launch import SMOLLM2, vllm_engines

GENERATE = "/inference/v1/generate"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
VARIANTS = ("off", "on")
_TOKEN = re.compile(rb'"token_ids":\[\d|"text":"[^"]|"content":"[^"]')


async def token_ids(session: aiohttp.ClientSession, decode: str, text: str) -> list[int]:
    async with session.post(f"{decode}/tokenize", json={"model": SMOLLM2, "prompt": text}) as r:
        assert r.status == 200, await r.text()
        ids: list[int] = (await r.json())["tokens"]
        return ids


def body(path: str, text: str, ids: list[int], tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {"model": SMOLLM2, "stream": True, "cache_salt": uuid.uuid4().hex}
    if path == GENERATE:
        out.update(token_ids=ids, sampling_params={"max_tokens": tokens, "temperature": 0})
        return out
    out.update(max_tokens=tokens, temperature=0)
    if path == CHAT:
        out["messages"] = [{"role": "user", "content": text}]
    else:
        out["prompt"] = text
    return out


async def timings(
    session: aiohttp.ClientSession, url: str, payload: dict[str, Any]
) -> tuple[float, float]:
    """Seconds to the first and to the second chunk that carries a token."""
    started, seen = time.perf_counter(), []
    async with session.post(url, json=payload) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if line.startswith(b"data: {") and _TOKEN.search(line) and len(seen) < 2:
                seen.append(time.perf_counter() - started)
    assert len(seen) == 2, seen
    return seen[0], seen[1]


async def phase_sums(session: aiohttp.ClientSession, url: str) -> dict[str, tuple[float, float]]:
    """Each phase's (sum in ms, count) so far, from the proxy's own histograms."""
    async with session.get(url + "/metrics") as r:
        text = await r.text()
    sums: dict[str, tuple[float, float]] = {}
    for name in ("pdproxy_prefill_duration_seconds", "pdproxy_kv_handoff_seconds"):
        total = re.search(rf"^{name}_sum (\S+)$", text, re.M)
        count = re.search(rf"^{name}_count (\S+)$", text, re.M)
        if total and count:
            sums[name] = float(total.group(1)) * 1000, float(count.group(1))
    return sums


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


async def measure(
    urls: dict[str, str], decode: str, args: argparse.Namespace
) -> list[dict[str, Any]]:
    rows = []
    async with aiohttp.ClientSession() as session:
        for size in args.sizes:
            text = prompt(size)
            ids = await token_ids(session, decode, text)
            for path in (GENERATE, COMPLETIONS, CHAT):
                first: dict[str, list[float]] = {v: [] for v in VARIANTS}
                second: dict[str, list[float]] = {v: [] for v in VARIANTS}
                for v in VARIANTS:  # warm-up, and the block size bounded (32 and 33 tokens)
                    for n in (32, 33, len(ids)):
                        await timings(session, urls[v] + GENERATE, body(GENERATE, text, ids[:n], 4))
                before = {v: await phase_sums(session, urls[v]) for v in VARIANTS}
                for i in range(args.requests):
                    for v in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
                        t1, t2 = await timings(session, urls[v] + path, body(path, text, ids, 8))
                        first[v].append(t1 * 1000)
                        second[v].append(t2 * 1000)
                after = {v: await phase_sums(session, urls[v]) for v in VARIANTS}
                row: dict[str, Any] = {"prompt_tokens": len(ids), "endpoint": path}
                for v in VARIANTS:
                    row[f"ttft_p50_{v}"] = statistics.median(first[v])
                    row[f"ttft_p99_{v}"] = p99(first[v])
                    row[f"second_p50_{v}"] = statistics.median(second[v])
                    for name, short in (
                        ("pdproxy_prefill_duration_seconds", "prefill"),
                        ("pdproxy_kv_handoff_seconds", "handoff"),
                    ):
                        s0, c0 = before[v].get(name, (0.0, 0.0))
                        s1, c1 = after[v].get(name, (0.0, 0.0))
                        row[f"{short}_ms_{v}"] = (s1 - s0) / (c1 - c0) if c1 > c0 else None
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


@contextlib.contextmanager
def proxies(prefill: str, decode: str, run_dir: Path) -> Iterator[dict[str, str]]:
    ports = {v: free_port() for v in VARIANTS}
    extra = {"off": (), "on": ("--first-token-from-prefill",)}
    with contextlib.ExitStack() as stack:
        for v in VARIANTS:
            quiet = ["--no-access-log", "--health-check-interval-secs", "0"]
            quiet += ["--engine-metrics-interval-secs", "0", "--render-once"]
            argv = proxy_args(ports[v], prefill, decode, *quiet, *extra[v])
            stack.enter_context(process(argv, str(run_dir / f"pdproxy-{v}.log")))
        urls = {v: f"http://127.0.0.1:{ports[v]}" for v in VARIANTS}
        for url in urls.values():
            asyncio.run(wait_healthy(url))
        yield urls


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| prompt | endpoint | TTFT p50 off / on | TTFT p99 off / on | 2nd token p50 off / on"
        " | prefill leg off / on | decode's first bytes after P (handoff) off / on |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['prompt_tokens']} tokens | `{r['endpoint']}`"
            f" | {_ms(r['ttft_p50_off'])} / {_ms(r['ttft_p50_on'])} ms"
            f" | {_ms(r['ttft_p99_off'])} / {_ms(r['ttft_p99_on'])} ms"
            f" | {_ms(r['second_p50_off'])} / {_ms(r['second_p50_on'])} ms"
            f" | {_ms(r['prefill_ms_off'])} / {_ms(r['prefill_ms_on'])} ms"
            f" | {_ms(r['handoff_ms_off'])} / {_ms(r['handoff_ms_on'])} ms |"
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
    with contextlib.ExitStack() as stack:
        if args.prefill and args.decode:
            prefill, decode = args.prefill, args.decode
        else:
            flags = ("--enable-scale-out", "--enable-prompt-tokens-details")
            pair = stack.enter_context(
                vllm_engines(connector="nixl", model=SMOLLM2, extra_args=flags, max_model_len=2560)
            )
            prefill, decode = pair.prefill_url, pair.decode_url
        run_dir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        urls = stack.enter_context(proxies(prefill, decode, run_dir))
        rows = asyncio.run(measure(urls, decode, args))
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
