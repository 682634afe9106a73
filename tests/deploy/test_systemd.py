"""deploy/systemd/pdproxy.service: systemd accepts it, its sandbox is tight, its stop timeout
covers pdproxy's drain, and pdproxy really runs inside that sandbox: every syscall it makes
on a request, a registration and a drain is allowed by the unit's SystemCallFilter, and it
works with writable+executable memory refused (the unit's MemoryDenyWriteExecute=yes)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from engines.ports import free_ports
from tests.deploy.manifests import ENV_EXAMPLE, ROOT, UNIT, env_file, unit_settings

SETTINGS = unit_settings()
UVICORN_SHUTDOWN_SECS = 5  # pdproxy/cli/main.py: timeout_graceful_shutdown after the drain
HARDENING = {
    "NoNewPrivileges": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateDevices": "yes",
    "CapabilityBoundingSet": "",
    "RestrictNamespaces": "yes",
    "LockPersonality": "yes",
    "MemoryDenyWriteExecute": "yes",
    "SystemCallArchitectures": "native",
    "KillSignal": "SIGTERM",
}


def systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip(
            "systemd-analyze not found (package systemd); test_unit_settings still checks "
            "the unit's settings"
        )
    return tool


def unit_for_verify(tmp_path: Path) -> Path:
    """The unit with ExecStart at this venv's pdproxy and the example env file, since
    `systemd-analyze verify` checks that both exist."""
    text = UNIT.read_text()
    text = re.sub(
        r"^ExecStart=\S+", f"ExecStart={Path(sys.executable).parent / 'pdproxy'}", text, flags=re.M
    )
    text = re.sub(r"^EnvironmentFile=.*$", f"EnvironmentFile={ENV_EXAMPLE}", text, flags=re.M)
    path = tmp_path / "pdproxy.service"
    path.write_text(text)
    return path


def test_unit_settings() -> None:
    for key, value in HARDENING.items():
        assert SETTINGS.get(key) == [value], key
    assert SETTINGS["DynamicUser"] == ["yes"] or SETTINGS.get("User", ["root"])[0] != "root"
    assert (
        SETTINGS["RestrictAddressFamilies"]
        and "AF_PACKET" not in SETTINGS["RestrictAddressFamilies"][0]
    )
    assert SETTINGS["EnvironmentFile"] == ["/etc/pdproxy/pdproxy.env"]
    # The stop timeout covers the drain (shutdown timeout) and uvicorn's shutdown after it.
    shutdown = float(env_file().get("PDPROXY_SHUTDOWN_TIMEOUT_SECS", "30"))
    assert float(SETTINGS["TimeoutStopSec"][0]) > shutdown + UVICORN_SHUTDOWN_SECS
    # pdproxy exits 2 on a bad configuration: restarting cannot fix that
    assert SETTINGS["RestartPreventExitStatus"] == ["2"]


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    tool = systemd_analyze()
    out = subprocess.run(
        [tool, "verify", str(unit_for_verify(tmp_path))], capture_output=True, text=True, timeout=60
    )
    complaints = [
        line for line in (out.stdout + out.stderr).splitlines() if "pdproxy.service" in line
    ]
    assert out.returncode == 0 and not complaints, out.stdout + out.stderr


def test_exposure_score(tmp_path: Path) -> None:
    tool = systemd_analyze()
    out = subprocess.run(
        [tool, "security", "--offline=true", str(unit_for_verify(tmp_path))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    match = re.search(r"Overall exposure level for pdproxy\.service: ([\d.]+)", out.stdout)
    if match is None:
        pytest.skip(f"this systemd-analyze has no offline security report: {out.stderr.strip()}")
    assert float(match[1]) <= 2.0, out.stdout  # "OK"; 1.4 when written


# ---- pdproxy inside the sandbox ------------------------------------------------------------

# Runs argv[1:] with the kernel's W^X (PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN), which refuses
# what systemd's MemoryDenyWriteExecute refuses; inherited across fork and exec.
MDWE_EXEC = """
import ctypes, os, sys
if sys.argv[1] == "mdwe" and ctypes.CDLL(None, use_errno=True).prctl(65, 1, 0, 0, 0) != 0:
    sys.exit(f"PR_SET_MDWE failed: errno {ctypes.get_errno()}")
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


def mdwe_supported() -> bool:
    """PR_SET_MDWE exists (Linux 6.3+); tried in a child, since it cannot be undone."""
    probe = "import ctypes, sys; sys.exit(ctypes.CDLL(None).prctl(65, 1, 0, 0, 0) != 0)"
    return sys.platform == "linux" and subprocess.run([sys.executable, "-c", probe]).returncode == 0


@dataclass
class SandboxRun:
    traced: bool
    mdwe: bool
    syscalls: set[str] = field(default_factory=set)
    failures: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def sandbox_run(tmp_path_factory: pytest.TempPathFactory) -> SandboxRun:
    """Two sim engines; pdproxy with only its ZMQ registry and two pdproxy-register sidecars
    (the xpyd-registered shape), each under strace and W^X where available; a request,
    a stream, /metrics, then SIGTERM for all. Records what failed and the syscalls used."""
    strace = shutil.which("strace")
    run = SandboxRun(traced=strace is not None, mdwe=mdwe_supported())
    if not (run.traced or run.mdwe):
        pytest.skip("neither strace nor PR_SET_MDWE (Linux 6.3+) is available")
    tmp = tmp_path_factory.mktemp("sandbox")
    p_port, d_port, kv_port, http_port, registry_port = free_ports(5)
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, *argv: str, sandboxed: bool = True) -> subprocess.Popen[bytes]:
        command = [sys.executable, *argv]
        if sandboxed:
            command = [sys.executable, "-c", MDWE_EXEC, "mdwe" if run.mdwe else "-", *argv]
            if run.traced:
                command = [strace, "-f", "-qq", "-ff", "-o", str(tmp / f"{name}.strace"), *command]
        log = open(tmp / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        log.close()
        procs.append(proc)
        return proc

    sim = [
        "-m",
        "engines.sim",
        "--host",
        "127.0.0.1",
        "--connector",
        "nixl",
        "--model",
        "sim-model",
    ]
    start(
        "prefill",
        *sim,
        "--role",
        "prefill",
        "--port",
        str(p_port),
        "--kv-port",
        str(kv_port),
        sandboxed=False,
    )
    start("decode", *sim, "--role", "decode", "--port", str(d_port), sandboxed=False)
    proxy = start(
        "pdproxy",
        "-m",
        "pdproxy",
        "--host",
        "127.0.0.1",
        "--port",
        str(http_port),
        "--registry-host",
        "127.0.0.1",
        "--registry-port",
        str(registry_port),
        "--kv-connector",
        "nixl",
        "--shutdown-timeout-secs",
        "5",
    )
    sidecars = [
        start(
            f"register-{role}",
            "-m",
            "engines.register",
            "--role",
            role,
            "--engine",
            f"http://127.0.0.1:{port}",
            "--proxy",
            f"tcp://127.0.0.1:{registry_port}",
            "--interval-s",
            "0.5",
        )
        for role, port in (("prefill", p_port), ("decode", d_port))
    ]
    base = f"http://127.0.0.1:{http_port}"
    try:
        with httpx.Client(base_url=base, timeout=10) as client:
            ready = wait_ready(client)
            if not ready:
                run.failures.append("pdproxy never turned ready from the sidecars' heartbeats")
            else:
                exercise(client, run)
        for proc in [*sidecars, proxy]:
            stop(proc, run, tmp)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if run.failures:
        for log in sorted(tmp.glob("*.log")):
            run.failures.append(f"--- {log.name}:\n{log.read_text(errors='replace')[-2000:]}")
    for trace in tmp.glob("*.strace.*"):
        run.syscalls |= set(
            re.findall(r"^([a-z_][a-z0-9_]*)\(", trace.read_text(errors="replace"), re.M)
        )
    return run


def wait_ready(client: httpx.Client, timeout: float = 60) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if client.get("/ready").status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    return False


def exercise(client: httpx.Client, run: SandboxRun) -> None:
    completion = client.post(
        "/v1/completions", json={"model": "sim-model", "prompt": "hello", "max_tokens": 4}
    )
    if completion.status_code != 200:
        run.failures.append(f"completion: {completion.status_code} {completion.text}")
    chat = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "stream": True,
    }
    with client.stream("POST", "/v1/chat/completions", json=chat) as stream:
        body = b"".join(stream.iter_bytes())
    if stream.status_code != 200 or b"data: [DONE]" not in body:
        run.failures.append(f"stream: {stream.status_code} {body[-200:]!r}")
    if client.get("/metrics").status_code != 200:
        run.failures.append("/metrics failed")


def stop(proc: subprocess.Popen[bytes], run: SandboxRun, tmp: Path) -> None:
    """SIGTERM to the sandboxed process itself (strace's child, when traced); expect exit 0."""
    target = proc.pid
    if run.traced:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        pids = children.read_text().split() if children.exists() else []
        target = int(pids[0]) if pids else proc.pid
    os.kill(target, signal.SIGTERM)
    try:
        code = proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        run.failures.append(f"{proc.args[-12:]} did not stop on SIGTERM")
        return
    if code != 0:
        run.failures.append(f"{proc.args[-12:]} exited {code} on SIGTERM")


def test_pdproxy_works_with_write_execute_memory_refused(sandbox_run: SandboxRun) -> None:
    if not sandbox_run.mdwe:
        pytest.skip("this kernel has no PR_SET_MDWE (Linux 6.3+) to refuse W+X memory with")
    assert not sandbox_run.failures, "\n".join(sandbox_run.failures)


def test_the_wx_refusal_is_real() -> None:
    """Under the wrapper a writable+executable mapping fails, as a JIT's would."""
    if not mdwe_supported():
        pytest.skip("this kernel has no PR_SET_MDWE (Linux 6.3+)")
    jit = "import mmap; mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)"
    out = subprocess.run(
        [sys.executable, "-c", MDWE_EXEC, "mdwe", "-c", jit], capture_output=True, text=True
    )
    assert out.returncode != 0 and "PermissionError" in out.stderr, out.stderr


def filter_groups(tool: str) -> dict[str, set[str]]:
    """systemd's @groups, each expanded to syscall names."""
    out = subprocess.run(
        [tool, "syscall-filter"], capture_output=True, text=True, timeout=60
    ).stdout
    raw: dict[str, list[str]] = {}
    current = None
    for line in out.splitlines():
        if line.startswith("@"):
            current = raw.setdefault(line.split()[0], [])
        elif current is not None and line.strip() and not line.strip().startswith("#"):
            current.append(line.strip())

    def expand(name: str, seen: frozenset[str] = frozenset()) -> set[str]:
        if not name.startswith("@"):
            return {name}
        return set().union(*(expand(x, seen | {name}) for x in raw.get(name, []) if x not in seen))

    return {name: expand(name) for name in raw}


def allowed_syscalls(tool: str) -> set[str]:
    groups = filter_groups(tool)
    allowed: set[str] = set()
    for line in SETTINGS["SystemCallFilter"]:
        deny = line.startswith("~")
        names = set().union(*(groups.get(n, {n}) for n in line.lstrip("~").split()))
        allowed = allowed - names if deny else allowed | names
    return allowed


def test_every_syscall_pdproxy_makes_passes_the_units_filter(sandbox_run: SandboxRun) -> None:
    if not sandbox_run.traced:
        pytest.skip("strace not found (.ci/run installs it); cannot list pdproxy's syscalls")
    tool = systemd_analyze()
    assert not sandbox_run.failures, "\n".join(sandbox_run.failures)
    assert len(sandbox_run.syscalls) > 30, sandbox_run.syscalls  # strace really saw the run
    refused = sandbox_run.syscalls - allowed_syscalls(tool)
    assert not refused, f"the unit's SystemCallFilter would refuse {sorted(refused)} (EPERM)"
