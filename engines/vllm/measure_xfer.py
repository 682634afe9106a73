#!/usr/bin/env python3
"""How long a NIXL KV transfer takes between a real vLLM CPU prefill and decode (stdlib only).

Starts a NIXL pair (free ports, like the tests), sends N disaggregated requests one after another
(P leg with max_tokens=1 and ``do_remote_decode``, then D with P's ``kv_transfer_params``), each
with a fresh prompt, and reports per request the decode's own transfer time
(``vllm:nixl_xfer_time_seconds`` sum/count deltas: NIXL's own time for the posted transfer) and
the time of each leg and of both, and the decode leg's time to its first token (streamed),
which is mostly the wait for the KV: vLLM's metric does not count the time the decode's
scheduler waits before the transfer is posted and after it completes. It also
prints the CPU affinity of every thread of each engine's worker process, which shows where
vLLM's NixlConnector pinned it.

    python3 engines/vllm/measure_xfer.py [--requests 20] [--model tiny-llama]
        [--worker-cpus vllm|keep|own]     # own (default): launch.py's PDPROXY_WORKER_CPUS;
                                          # vllm: vLLM's own pinning (the last core), for "before"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import urllib.request
import uuid
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engines.vllm.command import WORKER_CPUS_VAR
from engines.vllm.engine import Engine, metric_value
from engines.vllm.lifecycle import vllm_engines
from engines.vllm.process_family import family
from engines.vllm.settings import DEFAULT_MODEL, MODELS

TEXT = (
    "def schedule(requests, budget):\n    # pick the requests that fit in the token budget\n"
    "    chosen = []\n    for request in sorted(requests, key=len):\n"
)


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return dict(json.loads(resp.read()))


def post_stream(url: str, body: dict) -> float:
    """Stream the answer; return the seconds until its first token."""
    req = urllib.request.Request(
        url, json.dumps({**body, "stream": True}).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    first = 0.0
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            if not first and line.startswith(b"data: {"):
                first = time.perf_counter() - t0
    return first


def xfer(decode: Engine) -> tuple[float, float]:
    m = decode.metrics()
    return (
        metric_value(m, "vllm:nixl_xfer_time_seconds_sum"),
        metric_value(m, "vllm:nixl_xfer_time_seconds_count"),
    )


def affinities(eng: Engine) -> dict[str, list[str]]:
    """{process name: ["thread name: CPUs", ...]} for the engine's processes (main: the
    process's main thread)."""
    out: dict[str, list[str]] = {}
    for pid in sorted(family(eng.pid, eng.pid)):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            rows = []
            for task in sorted(Path(f"/proc/{pid}/task").iterdir(), key=lambda p: int(p.name)):
                status = (task / "status").read_text().splitlines()
                cpus = next(
                    s.split(":")[1].strip() for s in status if s.startswith("Cpus_allowed_list")
                )
                thread = "main" if task.name == str(pid) else (task / "comm").read_text().strip()
                rows.append(f"{thread}: {cpus}")
        except (OSError, StopIteration):
            continue
        out[f"{name} ({pid})"] = sorted(set(rows))
    return out


def measure(pair, requests: int, max_tokens: int) -> dict:
    xfer_ms: list[float] = []
    e2e_ms: list[float] = []
    p_ms: list[float] = []
    d_ms: list[float] = []
    d_first_ms: list[float] = []
    for i in range(requests + 1):  # the first one (the NIXL handshake) is not counted
        prompt = f"# request {i} {uuid.uuid4().hex}\n" + TEXT * 3
        body = {"model": pair.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        s0, c0 = xfer(pair.decode)
        t0 = time.perf_counter()
        p_body = {
            **body,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        }
        params = post(pair.prefill_url + "/v1/completions", p_body)["kv_transfer_params"]
        t1 = time.perf_counter()
        first = post_stream(
            pair.decode_url + "/v1/completions", {**body, "kv_transfer_params": params}
        )
        t2 = time.perf_counter()
        took = (t2 - t0) * 1000
        s1, c1 = xfer(pair.decode)
        if i == 0:
            continue
        e2e_ms.append(took)
        p_ms.append((t1 - t0) * 1000)
        d_ms.append((t2 - t1) * 1000)
        d_first_ms.append(first * 1000)
        if c1 > c0:
            xfer_ms.append((s1 - s0) / (c1 - c0) * 1000)
    return {
        "requests": requests,
        "transfers": len(xfer_ms),
        "xfer_ms": summary(xfer_ms),
        "end_to_end_ms": summary(e2e_ms),
        "prefill_leg_ms": summary(p_ms),
        "decode_leg_ms": summary(d_ms),
        "decode_first_token_ms": summary(d_first_ms),
    }


def summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {
        "min": round(ordered[0], 1),
        "p50": round(statistics.median(ordered), 1),
        "p90": round(ordered[int(0.9 * (len(ordered) - 1))], 1),
        "max": round(ordered[-1], 1),
        "mean": round(statistics.fmean(ordered), 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--model", default=DEFAULT_MODEL, choices=tuple(MODELS))
    ap.add_argument("--worker-cpus", default="own", help="vllm, keep, own, or a CPU list")
    args = ap.parse_args()
    if args.worker_cpus != "own":
        os.environ[WORKER_CPUS_VAR] = args.worker_cpus
    with vllm_engines("nixl", model=args.model) as pair:
        result = measure(pair, args.requests, args.max_tokens)
        result["worker_cpus"] = args.worker_cpus
        result["model"] = pair.model
        result["affinity"] = {e.role: affinities(e) for e in pair.engines}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
