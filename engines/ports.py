"""Free TCP ports for engines, proxies and tests, chosen outside the kernel's ephemeral range.

Asking the kernel for port 0 returns a port from the ephemeral range, and the kernel hands the same
range out again to every outgoing connection and every ``bind(0)``.  A vLLM engine opens dozens of
such sockets while it starts (its ZMQ channels, NIXL/UCX listeners), so a port picked that way for a
second engine can be taken before that engine binds it: CI once lost a NIXL side channel exactly so
(``Address already in use``).  Ports below the ephemeral range are never handed out implicitly;
the only remaining collision is an explicit bind by another program, which the bind check sees.
"""

from __future__ import annotations

import contextlib
import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20000  # below this live many well-known and registered services
_ATTEMPTS = 200


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (Linux default when it cannot be read)."""
    try:
        low, high = _RANGE_FILE.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def bindable(port: int, host: str = "127.0.0.1") -> bool:
    """Whether ``port`` can be bound on ``host`` and on all interfaces right now."""
    for addr in {host, "0.0.0.0"}:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((addr, port))
            except OSError:
                return False
    return True


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports that are free now and that the kernel never assigns implicitly."""
    low, _ = ephemeral_range()
    candidates = range(_LOWEST, low) if low - _LOWEST >= 1000 else range(0)
    rng = random.SystemRandom()
    picked: list[int] = []
    for _ in range(_ATTEMPTS):
        if len(picked) == count or not candidates:
            break
        port = rng.choice(candidates)
        if port not in picked and bindable(port, host):
            picked.append(port)
    if len(picked) < count:  # no room below the ephemeral range: let the kernel choose
        with contextlib.ExitStack() as held:  # held open together, so all distinct
            for _ in range(count - len(picked)):
                s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                s.bind((host, 0))
                picked.append(int(s.getsockname()[1]))
    return picked


def free_port(host: str = "127.0.0.1") -> int:
    """One free port; see :func:`free_ports`."""
    return free_ports(1, host)[0]
