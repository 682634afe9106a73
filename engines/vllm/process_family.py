"""Find and stop a process with all its descendants and its process group (Linux /proc, stdlib only).

vLLM's API server starts an engine core and workers; stopping only the leader can leave them
running, so everything here works on the whole family.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

from engines.vllm.settings import log


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        return False


def proc_table() -> list[tuple[int, int, int]]:
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


def family(pid: int, pgid: int) -> set[int]:
    """pid, all its descendants and all members of process group pgid."""
    table = proc_table()
    found = {p for p, _, g in table if g == pgid}
    if pid_alive(pid):
        found.add(pid)
    changed = True
    while changed:
        changed = False
        for p, pp, _ in table:
            if pp in found and p not in found:
                found.add(p)
                changed = True
    return found


def signal_all(pids: set[int], pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, sig)


def stop_family(
    pid: int, label: str, timeout: float = 30.0, popen: subprocess.Popen[bytes] | None = None
) -> None:
    """SIGTERM to the leader pid (its own session, so pgid == pid), then SIGKILL the whole family.

    `popen`, when this process started the leader, is polled and reaped.
    """
    pgid = pid
    members = family(pid, pgid)
    if not members:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if popen is not None:
            popen.poll()
        members = {p for p in members if pid_alive(p)} | family(pid, pgid)
        if not members:
            break
        if not pid_alive(pid):
            # Leader gone: make sure the engine core / workers follow.
            signal_all(members, pgid, signal.SIGTERM)
        time.sleep(0.25)
    else:
        log(
            f"{label} (pid {pid}) still running after {timeout:.0f} s; SIGKILL to {sorted(members)}"
        )
        signal_all(members, pgid, signal.SIGKILL)
        time.sleep(0.5)
    if popen is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(5)
