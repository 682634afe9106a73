"""Child processes for demos and benchmarks: started in their own session, always stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterator
from typing import IO


@contextlib.contextmanager
def process(args: list[str], output: IO[bytes] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``args`` until the block ends: SIGTERM to its process group, SIGKILL after 10 s."""
    proc = subprocess.Popen(
        args, stdout=output, stderr=subprocess.STDOUT if output else None, start_new_session=True
    )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
