"""pdproxy beside vllm-router (the Rust router) in front of the same 1P1D sims, in one run.

    python -m bench.vs_router --router anchor [--rev REV] [--rounds 3]

Per scenario (``short``: 32 concurrent 16-token streams as fast as possible; ``stream``: 64
concurrent 128-token streams at 200 tokens/s), it warms every path up, then runs rounds; in
each round the load goes to the decode directly, then through each proxy in turn (pdproxy
from this checkout, pdproxy at git revision ``--rev`` if given, vllm-router), so all of them
see the same machine state. Reported per proxy: CPU per request (user + system of the whole
process, every thread, from /proc), TTFT p50/p99 over all rounds, and the TTFT it adds over
the direct connection measured in the same rounds. The figures issue 12 compares.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench import load
from bench.anchor import Anchor, ensure
from bench.procs import cpu_seconds, process, proxy_args, sim_args, wait_healthy
from bench.variants import checkout as rev_checkout
from engines.ports import free_ports

_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Case:
    name: str
    concurrency: int
    max_tokens: int
    decode_tps: float
    total: int


CASES = {
    "short": Case("short: 32 concurrent, 16 tokens", 32, 16, 0, 4000),
    "stream": Case("stream: 64 concurrent, 128 tokens @200 tok/s", 64, 128, 200, 1280),
}


@dataclass
class Target:
    name: str
    url: str
    pid: int = 0  # 0: the direct connection, no proxy CPU to read
    cpu: float = 0.0
    user: float = 0.0
    syscalls: int = 0  # read + write syscalls (/proc/PID/io: syscr + syscw)
    requests: int = 0
    errors: int = 0
    ttft: list[float] = field(default_factory=list)

    def add(self, result: load.Result, cpu: tuple[float, float, int]) -> None:
        self.cpu += cpu[0]
        self.user += cpu[1]
        self.syscalls += cpu[2]
        self.requests += result.requests
        self.errors += result.errors
        self.ttft.extend(result.ttft)
        self.seconds += result.seconds

    seconds: float = 0.0

    def rps(self) -> str:
        return f"{self.name} {self.requests / max(self.seconds, 1e-9):.0f}"

    def ttft_ms(self, q: float) -> float:
        ordered = sorted(self.ttft)
        return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@contextlib.contextmanager
def _servers(
    case: Case, logdir: str, router: str | None, checkout: str | None
) -> Iterator[list[Target]]:
    p_port, d_port, x_port, r_port, m_port, k_port = free_ports(6)
    p_url, d_url = f"http://127.0.0.1:{p_port}", f"http://127.0.0.1:{d_port}"
    with contextlib.ExitStack() as stack:
        stack.enter_context(process(sim_args(p_port, "prefill", case.decode_tps), f"{logdir}/p"))
        stack.enter_context(process(sim_args(d_port, "decode", case.decode_tps), f"{logdir}/d"))
        targets = [Target("direct", d_url)]
        proxy = stack.enter_context(process(proxy_args(x_port, p_url, d_url), f"{logdir}/x"))
        targets.append(Target("pdproxy", f"http://127.0.0.1:{x_port}", proxy.pid))
        if checkout is not None:
            command = ["env", "-C", checkout, f"PYTHONPATH={checkout}"]
            command += proxy_args(k_port, p_url, d_url)
            other = stack.enter_context(process(command, f"{logdir}/k"))
            targets.append(Target("pdproxy@rev", f"http://127.0.0.1:{k_port}", other.pid))
        if router is not None:
            anchor = Anchor(Path(router), "given")
            args = anchor.command(r_port, p_url, d_url, m_port)
            rust = stack.enter_context(process(args, f"{logdir}/r"))
            targets.append(Target("vllm-router", f"http://127.0.0.1:{r_port}", rust.pid))
        yield targets


async def measure(case: Case, rounds: int, router: str | None, checkout: str | None) -> None:
    with tempfile.TemporaryDirectory() as logdir, _servers(case, logdir, router, checkout) as ts:
        for t in ts:
            await wait_healthy(t.url, timeout=60)
        shape = dict(concurrency=case.concurrency, max_tokens=case.max_tokens)
        for t in ts:
            await load.run(t.url, total=400, **shape)
        for _ in range(rounds):
            for t in ts:
                before = _usage(t.pid)
                result = await load.run(t.url, total=case.total, **shape)
                after = _usage(t.pid)
                t.add(result, (after[0] - before[0], after[1] - before[1], after[2] - before[2]))
    _report(case, ts)


def _usage(pid: int) -> tuple[float, float, int]:
    """CPU seconds (user + system), user seconds, read + write syscalls of ``pid``."""
    if not pid:
        return 0.0, 0.0, 0
    with open(f"/proc/{pid}/stat") as f:
        user = int(f.read().rsplit(")", 1)[1].split()[11]) / _CLK_TCK
    with open(f"/proc/{pid}/io") as f:
        io = dict(line.split(": ") for line in f.read().splitlines())
    return cpu_seconds(pid), user, int(io["syscr"]) + int(io["syscw"])


def _report(case: Case, targets: list[Target]) -> None:
    direct = targets[0]
    rounds = f"{direct.requests} requests per target, alternating"
    print(f"\n{case.name} ({rounds}; req/s: {', '.join(t.rps() for t in targets)})")
    print(
        "| target | CPU/request | of it user | read+write syscalls/request"
        " | TTFT p50 | TTFT p99 | added p50 | added p99 | errors |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for t in targets:
        p50, p99 = t.ttft_ms(0.5), t.ttft_ms(0.99)
        n = max(t.requests, 1)
        cpu = (
            f"{1000 * t.cpu / n:.3f} ms | {t.user / max(t.cpu, 1e-9):.0%} | {t.syscalls / n:.0f}"
            if t.pid
            else "- | - | -"
        )
        added = f"{p50 - direct.ttft_ms(0.5):+.2f} ms | {p99 - direct.ttft_ms(0.99):+.2f} ms"
        print(f"| {t.name} | {cpu} | {p50:.2f} ms | {p99:.2f} ms | {added} | {t.errors} |")
    ours = next(t for t in targets if t.name == "pdproxy")
    for t in targets:
        if t.pid and t is not ours:
            ratio = (ours.cpu / ours.requests) / (t.cpu / max(t.requests, 1))
            p50, p99 = (ours.ttft_ms(q) - t.ttft_ms(q) for q in (0.5, 0.99))
            print(
                f"pdproxy over {t.name}: CPU/request {ratio:.2f}x,"
                f" TTFT p50 {p50:+.2f} ms, p99 {p99:+.2f} ms (the same direct run subtracted"
                " from both, so this is the difference of the added TTFTs)"
            )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--router",
        help="the vllm-router executable; 'anchor': bench.anchor's venv, installed on first"
        " use, as make bench ANCHOR=vllm-router (omit: pdproxy only)",
    )
    parser.add_argument("--rev", help="also measure pdproxy at this git revision")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=sorted(CASES), default=sorted(CASES))
    args = parser.parse_args()
    checkout = rev_checkout(args.rev) if args.rev else None
    if args.router == "anchor":
        args.router = str(ensure().binary)
    for name in args.only:
        await measure(CASES[name], args.rounds, args.router, checkout)


if __name__ == "__main__":
    asyncio.run(main())
