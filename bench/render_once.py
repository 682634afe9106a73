"""What tokenize once (``--render-once``) saves or costs per request on the real CPU tier.

A real vLLM CPU NIXL pair (SmolLM2-135M-Instruct, ``--enable-scale-out``) behind two
pdproxy processes in the same run: one on the text path, one with ``--render-once``. Each
request goes to both, interleaved (the order alternating), streamed with one output
token and a fresh ``cache_salt`` (every prefill cold). Reported per prompt size and
endpoint: the time to first token's median (the client's first content chunk), and each
proxy's CPU per request (its process' user + system time over the run).

    make bench-render-once RENDER_ONCE_ARGS="--requests 10 --sizes 20,2000"

Needs the real-engine venv and model (``make engines-venv engines-smollm2``); it starts
and stops the engines itself, or uses a running pair (``--prefill URL --decode URL``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from bench.procs import process, proxy_args, wait_healthy
from engines.ports import free_port
from engines.vllm.launch import SMOLLM2, vllm_engines

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
VARIANTS = ("text", "render-once")
_WORDS = "the prefill computes the prompt and the decode reads its cache over the connector"


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of ``pid``, to the nanosecond (``/proc/*/schedstat``; the
    clock-tick figures of ``/proc/*/stat`` are 10 ms coarse)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def prompt(tokens: int) -> str:
    """About ``tokens`` tokens of English for SmolLM2's tokenizer (one a word)."""
    words = _WORDS.split()
    return " ".join(words[i % len(words)] for i in range(tokens))


def body(path: str, text: str) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": SMOLLM2,
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_salt": uuid.uuid4().hex,
    }
    if path == CHAT:
        out["messages"] = [{"role": "user", "content": text}]
    else:
        out["prompt"] = text
    return out


async def ttft(
    session: aiohttp.ClientSession, url: str, payload: dict[str, Any], tokens: list[int]
) -> float:
    """Seconds to the first chunk with content (chat's role chunk comes with it); the
    prompt's size in tokens goes into ``tokens``."""
    started = time.perf_counter()
    async with session.post(url, json=payload) as r:
        assert r.status == 200, await r.text()
        first = None
        async for line in r.content:
            if first is None and line.startswith(b"data: {") and b'"choices":[{' in line:
                first = time.perf_counter() - started
            if line.startswith(b"data: {") and b'"usage":{' in line:
                tokens.append(json.loads(line[6:])["usage"]["prompt_tokens"])
        assert first is not None
        return first


async def render_ms(session: aiohttp.ClientSession, decode: str, path: str, text: str) -> float:
    """The median time of the render call alone on the decode (tokenizer and template)."""
    times = []
    for _ in range(5):
        payload = {k: v for k, v in body(path, text).items() if k != "stream_options"}
        started = time.perf_counter()
        async with session.post(f"{decode}{path}/render", json=payload) as r:
            assert r.status == 200, await r.text()
            await r.read()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


async def measure(
    urls: dict[str, str], pids: dict[str, int], decode: str, args: argparse.Namespace
) -> list[dict[str, Any]]:
    rows = []
    async with aiohttp.ClientSession() as session:
        for size in args.sizes:
            for path in (COMPLETIONS, CHAT):
                text = prompt(size)
                times: dict[str, list[float]] = {v: [] for v in VARIANTS}
                tokens: list[int] = []
                for v in VARIANTS:  # warm-up: the fingerprint probe, pools, compile paths
                    await ttft(session, urls[v] + path, body(path, text), tokens)
                cpu_before = {v: cpu_seconds(pids[v]) for v in VARIANTS}
                for i in range(args.requests):
                    order = VARIANTS if i % 2 == 0 else VARIANTS[::-1]
                    for v in order:
                        payload = body(path, text)
                        times[v].append(await ttft(session, urls[v] + path, payload, tokens))
                cpu = {
                    v: (cpu_seconds(pids[v]) - cpu_before[v]) / args.requests * 1000
                    for v in VARIANTS
                }
                rendering = await render_ms(session, decode, path, text)
                rows.append(
                    {
                        "render_call_ms": rendering,
                        "prompt_words": size,
                        "prompt_tokens": statistics.median(tokens),
                        "endpoint": path,
                        **{f"ttft_ms_{v}": statistics.median(times[v]) * 1000 for v in VARIANTS},
                        **{f"proxy_cpu_ms_{v}": cpu[v] for v in VARIANTS},
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    return rows


@contextlib.contextmanager
def proxies(
    prefill: str, decode: str, run_dir: Path
) -> Iterator[tuple[dict[str, str], dict[str, int]]]:
    ports = {v: free_port() for v in VARIANTS}
    extra = {"text": (), "render-once": ("--render-once",)}
    with contextlib.ExitStack() as stack:
        pids = {}
        for v in VARIANTS:
            # no health checks or load scrapes: their CPU would count against the requests
            quiet = ["--no-access-log", "--health-check-interval-secs", "0"]
            quiet += ["--engine-metrics-interval-secs", "0"]
            argv = proxy_args(ports[v], prefill, decode, *quiet, *extra[v])
            proc = stack.enter_context(process(argv, str(run_dir / f"pdproxy-{v}.log")))
            pids[v] = proc.pid
        urls = {v: f"http://127.0.0.1:{ports[v]}" for v in VARIANTS}
        for url in urls.values():
            asyncio.run(wait_healthy(url))
        yield urls, pids


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| prompt | endpoint | TTFT text | TTFT render-once | difference"
        " | proxy CPU/request text | render-once | render call alone |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        text, once = r["ttft_ms_text"], r["ttft_ms_render-once"]
        lines.append(
            f"| {r['prompt_tokens']:.0f} tokens | `{r['endpoint']}` | {text:.1f} ms | {once:.1f} ms"
            f" | {once - text:+.1f} ms | {r['proxy_cpu_ms_text']:.2f} ms"
            f" | {r['proxy_cpu_ms_render-once']:.2f} ms | {r['render_call_ms']:.1f} ms |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10)
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[20, 2000])
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
        urls, pids = stack.enter_context(proxies(prefill, decode, run_dir))
        rows = asyncio.run(measure(urls, pids, decode, args))
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
