"""A 10,000 message/s garbage flood on the registry port must not slow client traffic.

pdproxy (a real uvicorn on loopback, before a 1P1D sim fleet, all in this process) serves
sequential requests, first quietly, then while another process floods its registry port with
malformed and oversized messages from several DEALER sockets. The flood's p99 latency is
compared with the quiet one, measured just before in the same test.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import resource
import statistics
import sys
import time

import aiohttp
import msgpack
import zmq

from engines.ports import free_port
from engines.sim import SimConfig, running_sim
from pdproxy.config.registry import RegistryConfig
from tests import latency
from tests.integration.conftest import MODEL, deployment
from tests.integration.test_registry import dealer, p2p

ROOT = pathlib.Path(__file__).resolve().parents[2]
RATE, FLOOD_S, QUIET_S = 10_000, 10.0, 5.0
GARBAGE_SOCKETS = 4
OVERSIZED_EVERY = 20  # one message in 20 goes to a socket of its own, past MAXMSGSIZE
MAX_REQUESTS = 50_000  # per phase: a bound on the loop, far above what 10 s allow
_OUTCOMES = ("malformed", "muted", "error")


def _garbage() -> list[list[bytes]]:
    """Malformed messages of every kind the registry refuses, cheap and costly to decode."""
    return [
        [b"\xc1"],
        [b""],
        [b"a", b"b", b"c"],
        [msgpack.dumps([1, 2, 3])],
        [msgpack.dumps({"type": "nope"})],
        [msgpack.dumps({"type": "P", "http_address": "nohost", "zmq_address": 7})],
        [msgpack.dumps({"type": ["P"]})],
        [b"y" * 1000],
        [msgpack.dumps(list(range(8_000)))],  # ~32 KiB whose decoding costs ~0.2 ms
    ]


def flood(endpoint: str, rate: int, seconds: float) -> None:
    """The sender, run in its own process: ``rate`` messages a second for ``seconds``,
    never blocking (a full queue counts as not sent), then one JSON line of counts.

    Niced: an attacker does not run on the proxy's machine, and on two shared cores an
    unniced sender would measure its own CPU, not pdproxy's cost of absorbing the garbage."""
    os.nice(10)
    ctx = zmq.Context()
    garbage = [ctx.socket(zmq.DEALER) for _ in range(GARBAGE_SOCKETS)]
    oversized = ctx.socket(zmq.DEALER)
    for sock in [*garbage, oversized]:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
    messages, big = _garbage(), [b"x" * (64 * 1024 + 1)]
    print("ready", flush=True)
    tick, sent, attempted = 0.005, 0, 0
    start = time.monotonic()
    while (elapsed := time.monotonic() - start) < seconds:
        for _ in range(int((elapsed + tick) * rate) - attempted):
            attempted += 1
            if attempted % OVERSIZED_EVERY == 0:
                sock, frames = oversized, big
            else:
                sock, frames = garbage[attempted % GARBAGE_SOCKETS], messages[attempted % 9]
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                continue
            sent += 1
        time.sleep(max(0.0, start + elapsed + tick - time.monotonic()))
    print(json.dumps({"attempted": attempted, "sent": sent}), flush=True)
    for sock in [*garbage, oversized]:
        sock.close(0)
    ctx.term()


async def _latencies(session: aiohttp.ClientSession, url: str, seconds: float) -> list[float]:
    """Sequential completions for ``seconds``; every one must succeed."""
    body = {"model": MODEL, "prompt": "flood test prompt", "max_tokens": 4}
    latencies: list[float] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and len(latencies) < MAX_REQUESTS:
        started = time.perf_counter()
        async with session.post(url + "/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            await response.read()
        latencies.append(time.perf_counter() - started)
    return latencies


def _p99(latencies: list[float]) -> float:
    return latency.p99(latencies)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


async def _flooded(
    endpoint: str, session: aiohttp.ClientSession, url: str
) -> tuple[list[float], dict[str, int]]:
    """Latencies measured while the sender process floods; the sender is always reaped."""
    code = f"from {__name__} import flood; flood({endpoint!r}, {RATE}, {FLOOD_S})"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, cwd=ROOT, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        assert await asyncio.wait_for(proc.stdout.readline(), 15) == b"ready\n"
        latencies = await _latencies(session, url, FLOOD_S)
        counts = json.loads(await asyncio.wait_for(proc.stdout.readline(), 10))
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        return latencies, counts
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_garbage_flood_leaves_client_latency_and_memory_bounded():
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    registry = RegistryConfig(port=port, host="127.0.0.1")
    async with (
        deployment(n_prefill=1, n_decode=1, proxy={"registry": registry}) as fleet,
        aiohttp.ClientSession() as session,
    ):
        url, metrics = fleet.proxy.url, fleet.proxy.state.metrics
        await _latencies(session, url, 0.5)  # warm-up: pools, caches
        # the quiet baseline on both sides of the flood, so it meets the machine the flood
        # met (CI saw quiet p99 at 7.5 ms in one run and 15.5 ms in another)
        quiet = await _latencies(session, url, QUIET_S / 2)
        rss_before = _peak_rss_mib()
        flooded, counts = await _flooded(endpoint, session, url)
        rss_growth = _peak_rss_mib() - rss_before
        quiet += await _latencies(session, url, QUIET_S / 2)

        quiet_p99, flood_p99 = _p99(quiet), _p99(flooded)
        outcomes = {o: metrics.registry_messages.labels(o)._value.get() for o in _OUTCOMES}
        print(  # the figures docs/registration.md quotes; shown with pytest -s
            f"\nquiet: {len(quiet)} requests, p99 {quiet_p99 * 1e3:.2f} ms;"
            f" flood: {len(flooded)} requests, p99 {flood_p99 * 1e3:.2f} ms;"
            f" sender {counts}; registry {outcomes}; peak RSS +{rss_growth:.1f} MiB"
        )
        # With the sender niced, flood/quiet p99 measured 1.4-1.5x, but a p99 of a few hundred
        # ~1 ms requests is one slow request on two shared cores: CI once saw 16 ms against
        # 4.7 ms quiet with every other figure sound. What a flood handled at any real cost per
        # message does is saturate the loop (10,000 msg/s at 0.1 ms each is the whole core):
        # every request then waits, the median moves by tens of ms and the tail by more. So the
        # median within 2x or 2 ms of quiet, and the tail within 30 ms; the mute and outcome
        # counts below are what pin the cheap path down.
        quiet_p50, flood_p50 = statistics.median(quiet), statistics.median(flooded)
        assert flood_p50 <= max(2 * quiet_p50, quiet_p50 + 0.002), (quiet_p50, flood_p50)
        assert flood_p99 <= quiet_p99 + 0.030, (quiet_p99, flood_p99)
        assert counts["sent"] >= 0.8 * RATE * FLOOD_S
        assert metrics.registry_mutes._value.get() >= GARBAGE_SOCKETS
        assert outcomes["muted"] >= 0.8 * (outcomes["muted"] + outcomes["malformed"])
        assert metrics.registry_messages.labels("error")._value.get() == 0
        assert rss_growth < 50

        # a valid engine registers once the flood is over
        async with (
            running_sim(SimConfig(role="decode", model=MODEL)) as extra,
            dealer(endpoint) as sock,
        ):
            await sock.send(p2p("D", extra))
            deadline = time.monotonic() + 5
            while fleet.proxy.state.registry.get(extra.url) is None:
                assert time.monotonic() < deadline, "registration after the flood was lost"
                await asyncio.sleep(0.01)
