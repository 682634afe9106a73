"""Start, stop and inspect a prefill/decode engine pair (the Python API behind launch.py)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engines.ports import free_ports
from engines.vllm.command import EngineSpec, engine_command
from engines.vllm.engine import (
    Engine,
    cleanup_state,
    load_engines,
    port_in_use,
    wait_healthy,
    write_state,
)
from engines.vllm.process_family import family
from engines.vllm.settings import (
    CONNECTORS,
    NIXL_CONNECTORS,
    SERVED_MODEL_NAME,
    EngineError,
    PortInUseError,
    Settings,
    ensure_ready,
    log,
    model_ready,
    venv_ready,
)

_PORT_ATTEMPTS = 3  # start-up tries when every port is ours to choose


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
    model: str | None = None,
    max_model_len: int | None = None,
    block_size: int = 32,
    kv_cache_gib: int = 1,
    extra_args: Sequence[str] = (),
    role_args: Mapping[str, Sequence[str]] | None = None,
) -> EnginePair:
    """Start a prefill and a decode engine in parallel and wait until both are healthy.

    model: a key of settings.MODELS ("tiny-llama", "smollm2-135m-instruct"); None keeps the
    settings' model (tiny-llama unless the settings say otherwise). It is built if missing.
    role_args: more arguments for one role only ({"prefill": [...]}), after ``extra_args``
    (an endpoint each engine binds, such as --kv-events-config's).
    On failure both are stopped and EngineError is raised (with the log tails).
    """
    if connector not in CONNECTORS:
        raise ValueError(f"connector must be one of {CONNECTORS}, not {connector!r}")
    settings = settings or Settings.from_env()
    if model is not None:
        settings = settings.with_model(model)
    _check_prepared(settings, ensure)
    run_dir = Path(run_dir) if run_dir is not None else settings.default_run_dir()
    ports = [prefill_port, decode_port]
    if connector in NIXL_CONNECTORS:
        ports += [prefill_side_channel_port, decode_side_channel_port]
    _prepare_run_dir(run_dir, ports)
    store = _fresh_store(run_dir, shared_storage_path) if connector == "example" else None
    specs = [
        EngineSpec("prefill", prefill_port, prefill_cpu_bind, prefill_side_channel_port),
        EngineSpec("decode", decode_port, decode_cpu_bind, decode_side_channel_port),
    ]
    command_options: dict[str, Any] = dict(
        shared_storage_path=store,
        max_model_len=max_model_len,
        block_size=block_size,
        kv_cache_gib=kv_cache_gib,
        kv_lease_duration=kv_lease_duration,
        nixl_prog_thread=nixl_prog_thread,
        extra_args=extra_args,
        role_args=dict(role_args or {}),
    )
    return _launch_pair(settings, specs, connector, run_dir, command_options, timeout)


def _check_prepared(settings: Settings, ensure: bool) -> None:
    """Build the venv and model (ensure), or check that they exist."""
    if ensure:
        ensure_ready(settings)
    elif not (venv_ready(settings) and model_ready(settings)):
        raise EngineError(
            f"venv {settings.venv} or model {settings.model_dir} missing; run `make engines-model`"
        )


def _prepare_run_dir(run_dir: Path, ports: Sequence[int]) -> None:
    """Create run_dir; refuse to start over engines recorded there or on a port already in use."""
    run_dir.mkdir(parents=True, exist_ok=True)
    running = [e for e in load_engines(run_dir) if e.alive()]
    if running:
        raise EngineError(
            f"engines already running from {run_dir}: "
            f"{', '.join(f'{e.role} pid {e.pid} port {e.port}' for e in running)}; stop them first"
        )
    for port in ports:
        if port_in_use(port):
            raise EngineError(f"port {port} on 127.0.0.1 is already in use")


def _fresh_store(run_dir: Path, shared_storage_path: Path | str | None) -> Path:
    """An empty ExampleConnector store.

    ExampleConnector never deletes its files; start each pair with an empty store so a stale
    entry can not pass for a transfer.
    """
    store = Path(shared_storage_path) if shared_storage_path else run_dir / "example-kv-store"
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)
    return store


def _launch_pair(
    settings: Settings,
    specs: Sequence[EngineSpec],
    connector: str,
    run_dir: Path,
    command_options: dict[str, Any],
    timeout: float,
) -> EnginePair:
    """Spawn the prefill and the decode engine (specs, in that order) and wait until both are healthy.

    On any failure (Ctrl+C included) the engines started so far are stopped.
    """
    engines: list[Engine] = []
    t0 = time.monotonic()
    try:
        for spec in specs:
            _spawn(settings, spec, connector, run_dir, command_options, started=engines)
        log(f"waiting up to {timeout:.0f} s for /health (about 30 s on a quiet machine) ...")
        wait_healthy(engines, timeout=timeout)
    except BaseException:
        for eng in engines:
            eng.stop(timeout=10)
        cleanup_state(run_dir)
        raise
    elapsed = time.monotonic() - t0
    urls = ", ".join(f"{e.role} {e.url}" for e in engines)
    log(f"both engines healthy in {elapsed:.1f} s: {urls}, model {settings.model!r}")
    prefill, decode = engines
    return EnginePair(
        prefill=prefill,
        decode=decode,
        connector=connector,
        run_dir=run_dir,
        model=settings.model,
        model_dir=settings.model_dir,
        shared_storage_path=command_options["shared_storage_path"],
        startup_seconds=elapsed,
    )


def _spawn(
    settings: Settings,
    spec: EngineSpec,
    connector: str,
    run_dir: Path,
    command_options: dict[str, Any],
    *,
    started: list[Engine],
) -> None:
    """Start one engine, logging to <run_dir>/<role>.log, and record its state file.

    The engine joins `started` as soon as it runs, so a failure after that still stops it.
    """
    options = dict(command_options)
    role_args = options.pop("role_args", {})
    options["extra_args"] = (*options["extra_args"], *role_args.get(spec.role, ()))
    argv, env = engine_command(settings, spec, connector, **options)
    log_path = run_dir / f"{spec.role}.log"
    popen = _popen_logged(argv, env, log_path, cwd=run_dir)
    eng = Engine(
        role=spec.role,
        port=spec.port,
        pid=popen.pid,
        log_path=log_path,
        host=spec.host,
        side_channel_port=spec.side_channel_port if connector in NIXL_CONNECTORS else None,
        _popen=popen,
    )
    started.append(eng)
    write_state(run_dir, eng, connector, argv)
    log(
        f"started {spec.role} engine: pid {popen.pid}, port {spec.port}, connector {connector}, "
        f"cpu bind {spec.cpu_bind}, log {log_path}"
    )


def _popen_logged(
    argv: list[str], env: dict[str, str], log_path: Path, cwd: Path
) -> subprocess.Popen[bytes]:
    """Start argv in a new session (its own process group), output to log_path after a `$ argv` line."""
    with open(log_path, "wb") as logf:
        logf.write(("$ " + " ".join(argv) + "\n").encode())
        logf.flush()
        return subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=str(cwd),
        )


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
        if eng.alive() or family(eng.pid, eng.pid):
            log(f"stopping {eng.role} engine (pid {eng.pid}, port {eng.port})")
            eng.stop(timeout=timeout)
            stopped.append(eng)
    cleanup_state(run_dir)
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
                "processes": len(family(eng.pid, eng.pid)),
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

    Keyword arguments go to start_engines (``model="smollm2-135m-instruct"`` for a real model
    that answers in English; the default, the random tiny-llama, starts fastest).

    Ports default to free ports below the kernel's ephemeral range (NIXL side-channel ports too),
    chosen afresh up to three times if an engine cannot bind one; the run dir defaults to a fresh
    temporary directory under $PDPROXY_CACHE/run that is removed on exit unless keep_run_dir (logs
    are kept if start-up fails).
    """
    settings = kwargs.pop("settings", None) or Settings.from_env()
    made_tmp = run_dir is None
    if made_tmp:
        base = settings.cache_dir / "run"
        base.mkdir(parents=True, exist_ok=True)
        run_dir = Path(tempfile.mkdtemp(prefix=f"{connector}-", dir=base))
    side_keys = ("prefill_side_channel_port", "decode_side_channel_port")
    chosen = not (prefill_port or decode_port or any(k in kwargs for k in side_keys))
    for attempt in range(1, _PORT_ATTEMPTS + 1):
        spare = iter(free_ports(4))
        options = dict(kwargs)
        if connector in NIXL_CONNECTORS:
            for key in side_keys:
                options.setdefault(key, next(spare))
        try:
            pair = start_engines(
                connector,
                prefill_port or next(spare),
                decode_port or next(spare),
                run_dir=run_dir,
                settings=settings,
                **options,
            )
            break
        except PortInUseError as exc:
            # Only ports we chose may be chosen again; an operator's ports are theirs to fix.
            if not chosen or attempt == _PORT_ATTEMPTS:
                raise
            log(f"{exc.args[0].splitlines()[0]}; retrying with fresh ports")
    try:
        yield pair
    finally:
        pair.stop()
        if made_tmp and not keep_run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)


@contextlib.contextmanager
def extra_engine(
    role: str,
    connector: str = "nixl",
    *,
    model: str | None = None,
    cpu_bind: str = "1",
    extra_args: Sequence[str] = (),
    timeout: float = 300.0,
    wait: bool = True,
) -> Iterator[Engine]:
    """One more engine beside a pair (a second decode, say), with a pair's defaults, on free
    ports in a fresh run dir; stopped (its whole process family) and the dir removed on exit.

    ``wait=False`` yields it as soon as it is spawned, for a pair to start beside it (three
    engines starting at once on two cores take less than a pair then one more); the caller
    waits with ``wait_healthy([engine])`` before using it.
    """
    settings = Settings.from_env()
    if model is not None:
        settings = settings.with_model(model)
    _check_prepared(settings, ensure=True)
    base = settings.cache_dir / "run"
    base.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"{connector}-{role}-", dir=base))
    port, side_channel = free_ports(2)
    _prepare_run_dir(run_dir, [port, side_channel])
    options: dict[str, Any] = dict(
        shared_storage_path=None,
        max_model_len=None,
        block_size=32,
        kv_cache_gib=1,
        kv_lease_duration=None,
        nixl_prog_thread=False,
        extra_args=extra_args,
    )
    started: list[Engine] = []
    try:
        spec = EngineSpec(role, port, cpu_bind, side_channel)
        _spawn(settings, spec, connector, run_dir, options, started=started)
        if wait:
            wait_healthy(started, timeout=timeout)
        yield started[0]
    finally:
        for engine in started:
            engine.stop(timeout=10)
            engine.alive()  # polls its Popen: a leader killed meanwhile is reaped
        cleanup_state(run_dir)
        shutil.rmtree(run_dir, ignore_errors=True)
