"""One running engine: its HTTP probes (/health, /metrics), its state file in the run dir, stopping it."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engines.vllm.process_family import pid_alive, stop_family
from engines.vllm.settings import ROLES, EngineError, PortInUseError, log


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
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


def tail(path: Path, lines: int = 40) -> str:
    try:
        data = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(data[-lines:])


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


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
        return pid_alive(self.pid)

    def healthy(self, timeout: float = 2.0) -> bool:
        return http_get(self.url + "/health", timeout)[0] == 200

    def metrics(self) -> dict[str, float]:
        status, text = http_get(self.url + "/metrics", 10.0)
        if status != 200:
            raise EngineError(f"{self.role}: GET /metrics returned {status}")
        return parse_metrics(text)

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(self.metrics(), name, **labels)

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the engine (vLLM shuts its engine core down), then SIGKILL the whole family."""
        # Started with start_new_session=True, so pgid == pid.
        stop_family(self.pid, self.role, timeout=timeout, popen=self._popen)


# A failed bind kills only the thread that tried it (NIXL's handshake listener, for one): the
# engine stays up without ever turning healthy, so its log is the only early sign.
_BIND_FAILURE = "Address already in use"


def _poll_pending(pending: list[Engine], t0: float, progress: bool) -> None:
    """Drop the engines that answer /health from pending; raise if one has exited or cannot bind."""
    for eng in list(pending):
        if eng.healthy():
            if progress:
                log(f"{eng.role} ready at {eng.url} after {time.monotonic() - t0:.1f} s")
            pending.remove(eng)
        elif not eng.alive():
            raise EngineError(
                f"{eng.role} engine (pid {eng.pid}, port {eng.port}) exited during start-up; "
                f"last lines of {eng.log_path}:\n{eng.log_tail()}"
            )
        elif _BIND_FAILURE in eng.log_tail(200):
            raise PortInUseError(
                f"{eng.role} engine (pid {eng.pid}, port {eng.port}) could not bind a port; "
                f"last lines of {eng.log_path}:\n{eng.log_tail()}"
            )


def wait_healthy(engines: Sequence[Engine], timeout: float = 300.0, progress: bool = True) -> float:
    """Poll /health of every engine until all answer 200; raise EngineError with log tails otherwise."""
    t0 = time.monotonic()
    pending = list(engines)
    last_report = t0
    while pending:
        _poll_pending(pending, t0, progress)
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
            log(f"waiting for {', '.join(e.role for e in pending)} ({now - t0:.0f} s): {last}")
            last_report = now
        time.sleep(1.0)
    return time.monotonic() - t0


# --------------------------------------------------------------------------------------------------
# State files in the run dir: <role>.json (what `status` and `down` read) and <role>.pid


def state_path(run_dir: Path, role: str) -> Path:
    return run_dir / f"{role}.json"


def write_state(run_dir: Path, eng: Engine, connector: str, argv: list[str]) -> None:
    state = {
        "role": eng.role,
        "pid": eng.pid,
        "port": eng.port,
        "host": eng.host,
        "log": str(eng.log_path),
        "connector": connector,
        "side_channel_port": eng.side_channel_port,
        "argv": argv,
    }
    state_path(run_dir, eng.role).write_text(json.dumps(state, indent=1))
    (run_dir / f"{eng.role}.pid").write_text(f"{eng.pid}\n")


def load_engines(run_dir: Path) -> list[Engine]:
    """Engines recorded in run_dir (whether or not they still run)."""
    engines = []
    for role in ROLES:
        path = state_path(run_dir, role)
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


def cleanup_state(run_dir: Path) -> None:
    for role in ROLES:
        for suffix in (".json", ".pid"):
            with contextlib.suppress(FileNotFoundError):
                (run_dir / f"{role}{suffix}").unlink()
