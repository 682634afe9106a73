"""``python -m tests.hostile.probe_health PORT [CONTROL]``: GET /health on 127.0.0.1:PORT on a
new connection every 20 ms, as an orchestrator probes, until stdin closes; then one JSON line:
each probe's seconds, the answers that were not 200, and (with a CONTROL port, a
``control_health`` server) the seconds of the same request to the control, sent right after
each probe: what the machine itself added at that moment.

A process of its own, so the attack's own work in the test process (its event loop, the
GIL) never counts in the latencies.
"""

from __future__ import annotations

import json
import select
import socket
import sys
import time

HEALTH = b"GET /health HTTP/1.1\r\nHost: pdproxy\r\nConnection: close\r\n\r\n"
EVERY = 0.02
LONGEST = 120.0  # seconds: a probe never outlives a lost test


def probe(port: int) -> bytes:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(HEALTH)
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
            return b"".join(chunks)
    except OSError as exc:
        return repr(exc).encode()


def main() -> None:
    port = int(sys.argv[1])
    control = int(sys.argv[2]) if len(sys.argv) > 2 else None
    latencies: list[float] = []
    controls: list[float] = []
    failures: list[str] = []
    deadline = time.monotonic() + LONGEST
    while time.monotonic() < deadline:
        started = time.perf_counter()
        answer = probe(port)
        latencies.append(time.perf_counter() - started)
        if not answer.startswith(b"HTTP/1.1 200"):
            failures.append(answer[:200].decode(errors="replace"))
        if control is not None:
            started = time.perf_counter()
            probe(control)
            controls.append(time.perf_counter() - started)
        if select.select([sys.stdin], [], [], EVERY)[0]:  # stdin closed: the attack is over
            break
    print(json.dumps({"latencies": latencies, "failures": failures, "control": controls}))


if __name__ == "__main__":
    main()
