"""Where a worker finds its owner and what it is told at start (stdlib only).

The supervisor creates one private run directory (mode 0700) per run: the membership
owner's two ``ipc://`` sockets live there, and prometheus_client's multiprocess files under
``metrics/``. It is removed when the supervisor exits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"
BOOT_FAILURE = 3  # a worker's exit status when it could not start serving


@dataclass(frozen=True, slots=True)
class RunDir:
    path: str

    @property
    def publish(self) -> str:
        """The owner's PUB socket: membership snapshots."""
        return f"ipc://{os.path.join(self.path, 'membership.pub')}"

    @property
    def control(self) -> str:
        """The owner's ROUTER socket: snapshot requests and admin writes."""
        return f"ipc://{os.path.join(self.path, 'control')}"

    @property
    def limits(self) -> str:
        """The tenants' limits every worker charges (``pdproxy.flow.shared``)."""
        return os.path.join(self.path, "limits")

    @property
    def metrics(self) -> str:
        """prometheus_client's multiprocess directory."""
        return os.path.join(self.path, "metrics")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One serving process: which of how many, where it listens, whom it follows."""

    index: int
    count: int
    port: int  # the resolved listening port (the supervisor resolved --port 0 once)
    run_dir: RunDir
    parent_pid: int  # the supervisor: when it is gone, the worker drains and exits
