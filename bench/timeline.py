"""Where a request's time goes through pdproxy under load: a per-phase timeline.

    python -m bench.timeline [--case stream|short] [--proxy-args "..."]

Runs a 1P1D sim fleet and pdproxy with its access log on (JSON), drives the case's load
with a client that stamps each request (sent, response headers, first body chunk) and names
it with ``X-Request-Id``, and joins those stamps with pdproxy's own access line for the same
request (the prefill leg's time, the decode's headers, pdproxy's time to first byte). The
phases, as medians and p99 over the requests:

- client → handler: from the client's send to pdproxy's handler starting (connection, the
  request's bytes, uvicorn's parse, the wait for pdproxy's event loop);
- handler → prefill sent, prefill leg, prefill → decode sent, decode headers, decode
  headers → first byte sent (the stream's first bytes awaited, the response's start);
- first byte sent → client: the write and the client's read of it.

pdproxy's stamps are its own ``time.perf_counter()`` values, from the access line's
millisecond fields; the client's are this process's. "client → handler" is the client's
TTFT minus pdproxy's time to first byte minus the last phase, which both sides share, so it
is derived: TTFT (client) - ttfb (pdproxy) = client → handler + first byte → client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp

from bench import load
from bench.procs import process, proxy_args, sim_args, wait_healthy
from engines.ports import free_ports

CASES = {"stream": (64, 128, 200.0, 1280), "short": (32, 16, 0.0, 4000)}


async def _drive(
    url: str, concurrency: int, total: int, max_tokens: int
) -> dict[str, tuple[float, float]]:
    """Client stamps per request id: (time to response headers, time to first chunk)."""
    payload = load.body(max_tokens, "sim-model")
    stamps: dict[str, tuple[float, float]] = {}
    remaining = total

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            rid = uuid.uuid4().hex
            headers = {"Content-Type": "application/json", "X-Request-Id": rid}
            sent = time.perf_counter()
            async with session.post(url + "/v1/completions", data=payload, headers=headers) as r:
                got_headers = time.perf_counter() - sent
                first = 0.0
                async for _ in r.content.iter_any():
                    if not first:
                        first = time.perf_counter() - sent
            stamps[rid] = (got_headers, first)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return stamps


def _access_lines(log: Path) -> dict[str, dict[str, float]]:
    lines: dict[str, dict[str, float]] = {}
    for raw in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(raw)
            if record.get("logger") == "pdproxy.access" and record.get("request_id"):
                lines[record["request_id"]] = record
    return lines


def _phases(stamps: dict[str, tuple[float, float]], lines: dict[str, dict[str, float]]) -> None:
    rows: dict[str, list[float]] = {}
    for rid, (_headers, first) in stamps.items():
        line = lines.get(rid)
        if line is None or line.get("prefill_ms") is None:
            continue
        ttfb, prefill, decode_headers = (
            line["ttfb_ms"],
            line["prefill_ms"],
            line["decode_headers_ms"],
        )
        values = {
            "client TTFT": 1000 * first,
            "client → handler, + first byte → client": 1000 * first - ttfb,
            "pdproxy ttfb (handler → first byte sent)": ttfb,
            "  prefill leg": prefill,
            "  decode headers (decode sent → headers)": decode_headers,
            "  the rest (parse, pick, bodies, prime, start)": ttfb - prefill - decode_headers,
        }
        for name, value in values.items():
            rows.setdefault(name, []).append(value)
    n = len(rows.get("client TTFT", []))
    print(f"{n} requests joined with their access lines")
    print("| phase | p50 | p90 | p99 |")
    print("|---|---|---|---|")
    for name, values in rows.items():
        ordered = sorted(values)
        p90, p99 = (ordered[min(n - 1, int(q * n))] for q in (0.9, 0.99))
        print(f"| {name} | {statistics.median(ordered):.2f} ms | {p90:.2f} ms | {p99:.2f} ms |")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", choices=sorted(CASES), default="stream")
    parser.add_argument("--proxy-args", default="", help="more pdproxy flags")
    args = parser.parse_args()
    concurrency, max_tokens, tps, total = CASES[args.case]
    p, d, x = free_ports(3)
    p_url, d_url, x_url = (f"http://127.0.0.1:{port}" for port in (p, d, x))
    with tempfile.TemporaryDirectory() as logdir, contextlib.ExitStack() as stack:
        stack.enter_context(process(sim_args(p, "prefill", tps), f"{logdir}/p.log"))
        stack.enter_context(process(sim_args(d, "decode", tps), f"{logdir}/d.log"))
        flags = ["--log-level", "info", "--log-format", "json", *shlex.split(args.proxy_args)]
        stack.enter_context(process(proxy_args(x, p_url, d_url, *flags), f"{logdir}/x.log"))
        for url in (p_url, d_url, x_url):
            await wait_healthy(url)
        await _drive(x_url, concurrency, 400, max_tokens)
        stamps = await _drive(x_url, concurrency, total, max_tokens)
        await asyncio.sleep(0.5)  # the last access lines
        _phases(stamps, _access_lines(Path(f"{logdir}/x.log")))


if __name__ == "__main__":
    asyncio.run(main())
