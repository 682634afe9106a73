"""``python -m tests.hostile.control_health``: the control beside pdproxy's ``/health`` in the
hostile tests. A minimal HTTP/1.1 server in a process of its own that answers 200 to any
request; it prints the port it bound, then serves until stdin closes.

``probe_health`` probes it right after each ``/health``: its latencies are what the machine
itself (a loaded CI runner, another test on the other xdist worker) adds to any probe at that
moment, so a test bounds pdproxy's ``/health`` above what the control took, not absolutely.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Iterator

ANSWER = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.write(ANSWER)
        await writer.drain()
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
        pass
    finally:
        writer.close()


async def main() -> None:
    server = await asyncio.start_server(_answer, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until stdin closes
    server.close()


@contextlib.contextmanager
def running_control() -> Iterator[int]:
    """The control in a process of its own, for the block's length; yields its port."""
    server = [sys.executable, "-m", "tests.hostile.control_health"]
    with subprocess.Popen(server, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as control:
        assert control.stdout is not None
        port = int(control.stdout.readline().strip())
        try:
            yield port
        finally:
            control.communicate(timeout=10)  # closes its stdin: it stops


if __name__ == "__main__":
    asyncio.run(main())
