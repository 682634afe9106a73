"""`pdproxy-sim` / `python -m engines.sim`: run one simulated vLLM engine standalone."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from engines.sim.config import CERT_REQS, REGISTER_FORMATS, TRANSFER_MODES, Faults, SimConfig
from engines.sim.connectors import CONNECTORS
from engines.sim.server import SimServer, server_ssl_context

log = logging.getLogger("engines.sim")
CRASH_EXIT_CODE = 137  # what a shell reports for a SIGKILLed process (128 + 9)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdproxy-sim",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="A simulated vLLM engine (OpenAI API + KV connectors) for pdproxy tests.",
    )
    d = SimConfig()
    add = p.add_argument
    add("--host", default=d.host, help="Address the HTTP server binds to.")
    add("--port", type=int, default=8000, help="HTTP port; 0 picks a free port.")
    add("--model", default=d.model, help="Served model name.")
    add("--served-models", nargs="*", default=[], help="More base models served besides --model.")
    add("--lora-modules", nargs="*", default=[], help="NAME=PATH LoRA adapters loaded at start.")
    add("--max-model-len", type=int, default=d.max_model_len, help="Context length in tokens.")
    add(
        "--role",
        choices=("prefill", "decode", "both"),
        default=d.role,
        help="Engine role in a PD deployment; both is a plain engine.",
    )
    add(
        "--connector",
        choices=sorted(CONNECTORS),
        default=d.connector,
        help="KV connector: nixl (pull), nixl-push (vLLM 0.32 push), moriio (READ pull / WRITE"
        " push), p2p-nccl (push), "
        "mooncake (bootstrap + pull), all over TCP, or example (shared dir).",
    )
    add(
        "--engine-id",
        default=None,
        help="Engine id reported as remote_engine_id; unset means a random uuid4.",
    )
    _add_kv_flags(p, d)
    _add_id_connector_flags(p, d)
    _add_register_flags(p, d)
    _add_timing_flags(p, d)
    _add_tls_flags(p, d)
    _add_fault_flags(p)
    add("--log-level", default="info", help="Logging level.")
    return p


def _add_kv_flags(p: argparse.ArgumentParser, d: SimConfig) -> None:
    add = p.add_argument
    add("--kv-host", default=d.kv_host, help="Side-channel bind address, reported as remote_host.")
    add("--kv-port", type=int, default=d.kv_port, help="Side-channel port; 0 picks a free port.")
    add(
        "--kv-lease-s",
        type=float,
        default=d.kv_lease_s,
        help="Seconds a prefill holds un-pulled KV blocks before freeing them.",
    )
    add("--kv-dir", default=d.kv_dir, help="Shared KV directory for the example connector.")
    add("--block-size", type=int, default=d.block_size, help="Tokens per KV block.")
    add(
        "--num-blocks",
        type=int,
        default=d.num_blocks,
        help="KV block capacity (denominator of vllm:kv_cache_usage_perc).",
    )
    add(
        "--prefix-cache-blocks",
        type=int,
        default=d.prefix_cache_blocks,
        help="Blocks the prefix cache remembers.",
    )
    add(
        "--kv-events-endpoint",
        default=d.kv_events_endpoint,
        help="Publish KV cache events as vLLM's ZMQ publisher on this bound endpoint.",
    )
    add(
        "--kv-events-replay-endpoint",
        default=d.kv_events_replay_endpoint,
        help="The KV events replay (ROUTER) endpoint.",
    )
    add(
        "--kv-events-encoding",
        choices=("map", "array"),
        default=d.kv_events_encoding,
        help="Events as tagged maps (vLLM 0.32) or positional arrays (earlier releases).",
    )
    add(
        "--dp-size",
        type=int,
        default=d.dp_size,
        help="Data-parallel size for X-data-parallel-rank.",
    )


def _add_id_connector_flags(p: argparse.ArgumentParser, d: SimConfig) -> None:
    add = p.add_argument
    add("--tp-size", type=int, default=d.tp_size, help="Tensor-parallel size to report.")
    add(
        "--transfer-mode",
        choices=TRANSFER_MODES,
        default=d.transfer_mode,
        help="MoRIIO transfer mode: READ (D pulls, serial) or WRITE (P pushes, concurrent).",
    )
    add(
        "--kv-wait-timeout-s",
        type=float,
        default=d.kv_wait_timeout_s,
        help="Seconds a decode waits for pushed or not-yet-prefilled KV before failing.",
    )
    add(
        "--bootstrap-port",
        type=int,
        default=d.bootstrap_port,
        help="Mooncake bootstrap HTTP port (vLLM uses 8998); 0 picks a free port.",
    )


def _add_register_flags(p: argparse.ArgumentParser, d: SimConfig) -> None:
    add = p.add_argument
    add(
        "--register",
        default=d.register,
        help="Proxy ROUTER address (tcp://host:port) to send registration heartbeats to.",
    )
    add(
        "--register-format",
        choices=REGISTER_FORMATS,
        default=d.register_format,
        help="Registration payload: p2p, moriio or moriio-legacy.",
    )
    add(
        "--register-interval-s",
        type=float,
        default=d.register_interval_s,
        help="Seconds between registration heartbeats.",
    )
    add(
        "--zmq-address",
        default=d.zmq_address,
        help="zmq_address to register; unset derives it from --kv-host and the KV port.",
    )


def _add_timing_flags(p: argparse.ArgumentParser, d: SimConfig) -> None:
    add = p.add_argument
    add("--strict", action="store_true", help="Reject prefill-contract violations with HTTP 400.")
    add("--ttft-ms", type=float, default=d.ttft_ms, help="Fixed time to first token, in ms.")
    add(
        "--prefill-us-per-token",
        type=float,
        default=d.prefill_us_per_token,
        help="Prefill cost per locally computed prompt token, in microseconds.",
    )
    add(
        "--decode-tps",
        type=float,
        default=d.decode_tps,
        help="Decode tokens per second per stream; 0 is as fast as possible.",
    )
    add(
        "--max-running",
        type=int,
        default=d.max_running,
        help="Requests running at once; the rest wait in a FIFO queue.",
    )
    add(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default=d.scheduling_policy,
        help="As vLLM's: waiting requests first come first served, or by the body's priority"
        " (lower first), then arrival.",
    )
    add(
        "--prefill-concurrency",
        type=int,
        default=d.prefill_concurrency,
        help="Prefills computing at once per DP rank (they share one accelerator); the rest "
        "queue FIFO for compute while counted as running. 0 is unlimited.",
    )
    add(
        "--keep-alive-s",
        type=float,
        default=d.keep_alive_s,
        help="Idle keep-alive timeout of client connections, in seconds.",
    )
    add(
        "--record-limit",
        type=int,
        default=d.record_limit,
        help="How many request records /sim/requests keeps.",
    )
    add(
        "--responses-store",
        action="store_true",
        help="/v1/responses keeps responses for previous_response_id "
        "(vLLM's VLLM_ENABLE_RESPONSES_API_STORE=1).",
    )


def _add_tls_flags(p: argparse.ArgumentParser, d: SimConfig) -> None:
    add = p.add_argument
    add("--ssl-keyfile", default=d.ssl_keyfile, help="Private key of the HTTPS listener.")
    add("--ssl-certfile", default=d.ssl_certfile, help="Certificate; set, the sim serves HTTPS.")
    add("--ssl-ca-certs", default=d.ssl_ca_certs, help="CA that signs client certificates.")
    add(
        "--ssl-cert-reqs",
        type=int,
        choices=CERT_REQS,
        default=d.ssl_cert_reqs,
        help="Client certificates: 0 none, 1 optional, 2 required (as vLLM).",
    )


# Fault flags as (flag, type or None for a switch, default, help); --fault-x-y sets Faults.x_y.
_FAULT_FLAGS: tuple[tuple[str, type | None, Any, str], ...] = (
    ("--fault-status", int, None, "Answer every generation request with this HTTP status."),
    ("--fault-hang", None, False, "Accept generation requests, never answer."),
    ("--fault-close-after-tokens", int, None, "Abort the TCP connection after N streamed tokens."),
    ("--fault-refuse-connections", None, False, "Close the listening socket (clear to reopen)."),
    ("--fault-slow-start-s", float, 0.0, "/health answers 503 for the first N seconds."),
    ("--fault-headers-delay-s", float, 0.0, "Generation: wait N s before sending anything."),
    ("--fault-reset-after-bytes", int, None, "Generation: headers and N body bytes, then a reset."),
    ("--fault-hang-after-tokens", int, None, "Go silent after N tokens until the client leaves."),
    ("--fault-error-after-tokens", int, None, "Streams: vLLM's error event after N tokens."),
    ("--fault-fail-kv-load", None, False, "A decode's remote KV load fails (policy fail)."),
    ("--fault-health-delay-s", float, 0.0, "/health and /ping answer only after N seconds."),
    ("--fault-health-status", int, None, "/health and /ping answer this status."),
)


def _add_fault_flags(p: argparse.ArgumentParser) -> None:
    for flag, kind, default, text in _FAULT_FLAGS:
        if kind is None:
            p.add_argument(flag, action="store_true", help=text)
        else:
            p.add_argument(flag, type=kind, default=default, help=text)


# SimConfig's fields read from the command line as they are (the rest are built below)
_PLAIN_FIELDS = (
    "host",
    "port",
    "model",
    "max_model_len",
    "role",
    "connector",
    "kv_host",
    "kv_port",
    "kv_lease_s",
    "kv_dir",
    "block_size",
    "num_blocks",
    "prefix_cache_blocks",
    "kv_events_endpoint",
    "kv_events_replay_endpoint",
    "kv_events_encoding",
    "dp_size",
    "tp_size",
    "transfer_mode",
    "kv_wait_timeout_s",
    "bootstrap_port",
    "register",
    "register_format",
    "register_interval_s",
    "zmq_address",
    "strict",
    "ttft_ms",
    "prefill_us_per_token",
    "decode_tps",
    "max_running",
    "scheduling_policy",
    "prefill_concurrency",
    "keep_alive_s",
    "record_limit",
    "responses_store",
    "ssl_keyfile",
    "ssl_certfile",
    "ssl_ca_certs",
    "ssl_cert_reqs",
)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    # every Faults field has its --fault-<name> flag (``_add_fault_flags``)
    faults = Faults(
        **{f.name: getattr(args, f"fault_{f.name}") for f in dataclasses.fields(Faults)}
    )
    kwargs: dict[str, Any] = {name: getattr(args, name) for name in _PLAIN_FIELDS}
    if args.engine_id:
        kwargs["engine_id"] = args.engine_id
    kwargs["served_models"] = tuple(args.served_models)
    kwargs["lora_modules"] = tuple(args.lora_modules)
    return SimConfig(faults=faults, **kwargs)


async def serve(config: SimConfig) -> None:
    server = SimServer(config)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # SIGINT is sent by Ctrl+C
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGUSR1, crash)
    await stop.wait()
    log.info("shutting down")
    await server.stop()


def crash() -> None:
    """SIGUSR1: exit at once with 137, as a crashed engine; nothing is flushed.

    The kernel closes the sockets. For benchmarks that want a crash without a
    supervisor-visible SIGKILL.
    """
    os._exit(CRASH_EXIT_CODE)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = config_from_args(args)
    except ValueError as exc:
        log.error("invalid configuration: %s", exc)
        sys.exit(1)
    try:
        server_ssl_context(config)  # read again at start; here for a one-line error
    except OSError as exc:
        log.error("cannot load the --ssl-* files: %s", exc.strerror or exc)
        sys.exit(1)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(config))
    else:
        uvloop.run(serve(config))
