"""The event-loop lag of a server under load, measured from outside: a tiny request to its
``/health`` every 10 ms, from a process of its own, on one kept-alive connection.

    python -m bench.loop_probe HOST PORT [--interval 0.01]

Runs until its stdin closes, then prints one JSON list of ``[monotonic time, seconds]``
pairs: when each probe was sent and how long its answer took. A probe's latency is the
server's wait for its loop plus a constant (the round trip, the handler); the caller takes
the constant as the median latency while the server is idle (``lag``). Its own process, so
the load generator's loop does not delay it; blocking sockets, so nothing but the server
and the kernel's scheduling stands between the send and the answer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import select
import socket
import sys
import time
from collections.abc import AsyncIterator, Sequence
from urllib.parse import urlsplit

from bench.phases import quantile

_REQUEST = b"GET /health HTTP/1.1\r\nHost: probe\r\n\r\n"


def _answer(sock: socket.socket) -> None:
    """Read one whole response (headers and a Content-Length body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError("closed")
        rest += chunk


def probe(host: str, port: int, interval: float) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    next_at = time.monotonic()
    while True:
        sent = time.monotonic()
        sock.sendall(_REQUEST)
        _answer(sock)
        out.append((sent, time.monotonic() - sent))
        next_at = max(next_at + interval, time.monotonic())
        wait = max(0.0, next_at - time.monotonic())
        ready, _, _ = select.select([sys.stdin], [], [], wait)
        if ready:  # stdin closed (or written to): the caller is done
            return out


def lag(samples: Sequence[tuple[float, float]], start: float, end: float) -> dict[str, float]:
    """The loop's lag in ms over [start, end): each probe's latency there minus the median
    latency before ``start`` (the server idle). ``loop_lag_*`` figures, or {} if either
    period has no probe."""
    idle = [s for t, s in samples if t < start]
    busy = [s for t, s in samples if start <= t < end]
    if not idle or not busy:
        return {}
    base = quantile(idle, 0.5)
    lags = [max(0.0, 1000 * (s - base)) for s in busy]
    return {
        "loop_idle_ms": 1000 * base,
        "loop_lag_p50": quantile(lags, 0.5),
        "loop_lag_p99": quantile(lags, 0.99),
        "loop_lag_max": max(lags),
        "loop_probes": len(lags),
    }


@contextlib.asynccontextmanager
async def probing(url: str, interval: float = 0.01) -> AsyncIterator[list[tuple[float, float]]]:
    """Probe ``url``'s loop while the block runs; the list it yields holds the samples once
    the block has ended."""
    parts = urlsplit(url)
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "bench.loop_probe", str(parts.hostname), str(parts.port)),
        *("--interval", str(interval)),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdin is not None and proc.stdout is not None
    samples: list[tuple[float, float]] = []
    try:
        yield samples
    finally:
        proc.stdin.close()
        out = await proc.stdout.read()
        await proc.wait()
        samples.extend((float(t), float(s)) for t, s in json.loads(out or b"[]"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    parser.add_argument("--interval", type=float, default=0.01)
    args = parser.parse_args()
    print(json.dumps(probe(args.host, args.port, args.interval)))


if __name__ == "__main__":
    main()
