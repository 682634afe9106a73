"""`pdproxy-register`: register a running engine with a pdproxy ZMQ registry while it is healthy.

For engines that cannot register themselves (NIXL, Mooncake, a vLLM without P2P-NCCL or
MoRIIO), this sidecar sends the same msgpack payload vLLM's own heartbeat sends, every
`--interval-s`, but only while the engine's `GET /health` answers 200 (checked before each
send). A dead engine therefore drops out of the proxy's registry within its TTL, and comes
back on the first healthy tick. SIGTERM/SIGINT exit with status 0.

    pdproxy-register --role prefill --engine http://10.0.0.5:8100 --proxy tcp://10.0.0.1:30001 \\
        --zmq-address 10.0.0.5:14579
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from urllib.parse import urlsplit

import aiohttp

from engines.sim.registration import (
    FORMATS,
    ROLE_CODES,
    Heartbeat,
    Registrant,
    build_payload,
    moriio_zmq_address,
)

log = logging.getLogger("engines.register")
HEALTH_TIMEOUT_S = 1.0
DEFAULT_KV_PORT = 14579  # vLLM KVTransferConfig.kv_port
MORIIO_HANDSHAKE_PORT = 6301  # MoRIIO defaults (moriio_common.py)
MORIIO_NOTIFY_PORT = 61005


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdproxy-register",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Send vLLM-style registration heartbeats for an engine while it is healthy.",
    )
    add = p.add_argument
    add("--role", choices=sorted(ROLE_CODES), required=True, help="The engine's PD role.")
    add("--engine", required=True, help="The engine's base URL, http://host:port.")
    add("--proxy", required=True, help="The proxy's registry ROUTER, tcp://host:port.")
    add(
        "--zmq-address",
        default=None,
        help="zmq_address to register; default host:14579 (p2p) or "
        "host:H,handshake:6301,notify:61005 (moriio).",
    )
    add(
        "--format",
        choices=FORMATS,
        default=None,
        help="Payload format; default moriio if --dp-size/--tp-size/--transfer-mode is given, "
        "else p2p.",
    )
    add("--dp-size", type=int, default=None, help="Data-parallel size (moriio payload).")
    add("--tp-size", type=int, default=None, help="Tensor-parallel size (moriio payload).")
    add(
        "--transfer-mode",
        choices=("READ", "WRITE"),
        default=None,
        help="MoRIIO transfer mode (moriio payload).",
    )
    add("--interval-s", type=float, default=3.0, help="Seconds between heartbeats.")
    add("--log-level", default="info", help="Logging level.")
    return p


def registrant_from_args(args: argparse.Namespace) -> tuple[str, Registrant]:
    """The payload format and what to register; raises ValueError on a bad --engine."""
    parts = urlsplit(args.engine)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(f"--engine must be http://host:port, not {args.engine!r}")
    host = parts.hostname
    moriio_given = any(v is not None for v in (args.dp_size, args.tp_size, args.transfer_mode))
    fmt = args.format or ("moriio" if moriio_given else "p2p")
    zmq_address = args.zmq_address
    if zmq_address is None:
        zmq_address = (
            f"{host}:{DEFAULT_KV_PORT}"
            if fmt == "p2p"
            else moriio_zmq_address(host, MORIIO_HANDSHAKE_PORT, MORIIO_NOTIFY_PORT)
        )
    reg = Registrant(
        role=ROLE_CODES[args.role],
        http_address=f"{host}:{parts.port}",
        zmq_address=zmq_address,
        dp_size=args.dp_size or 1,
        tp_size=args.tp_size or 1,
        transfer_mode=args.transfer_mode or "READ",
    )
    return fmt, reg


class HealthGate:
    """`GET /health` before each send; logs only when the engine goes up or down."""

    def __init__(self, session: aiohttp.ClientSession, engine: str) -> None:
        self.session = session
        self.url = engine.rstrip("/") + "/health"
        self.up: bool | None = None

    async def __call__(self) -> bool:
        try:
            async with self.session.get(self.url) as resp:
                up = resp.status == 200
                why = f"HTTP {resp.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            up, why = False, type(exc).__name__
        if up != self.up:
            if up:
                log.info("engine %s is healthy; registering", self.url)
            else:
                log.warning("engine %s is unhealthy (%s); not registering", self.url, why)
            self.up = up
        return up


async def run(args: argparse.Namespace, fmt: str, reg: Registrant) -> None:
    payload = build_payload(fmt, reg)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # SIGINT is sent by Ctrl+C
        loop.add_signal_handler(sig, stop.set)
    timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
    # a fresh connection per probe: a pooled keep-alive socket would hide a closed listener
    connector = aiohttp.TCPConnector(limit=1, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        # No socket identity: a sidecar is not the engine, and two sidecars with the same
        # (default) zmq_address must not collide on the proxy's ROUTER.
        heartbeat = Heartbeat(
            args.proxy, payload, args.interval_s, gate=HealthGate(session, args.engine)
        )
        log.info(
            "pdproxy-register: %s -> %s every %gs: %s",
            args.engine,
            args.proxy,
            args.interval_s,
            payload,
        )
        heartbeat.start()
        try:
            await stop.wait()
        finally:
            log.info("stopping")
            await heartbeat.stop()


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.interval_s <= 0:
            raise ValueError("--interval-s must be > 0")
        fmt, reg = registrant_from_args(args)
        build_payload(fmt, reg)
    except ValueError as exc:
        log.error("invalid configuration: %s", exc)
        sys.exit(2)
    asyncio.run(run(args, fmt, reg))


if __name__ == "__main__":
    main()
