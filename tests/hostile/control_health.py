"""``python -m tests.hostile.control_health``: the control beside pdproxy's ``/health`` in the
hostile tests. A minimal HTTP/1.1 server in a process of its own that answers 200 to any
request; it prints the port it bound, then serves until stdin closes.

``probe_health`` probes it right after each ``/health``: its latencies are what the machine
itself (a loaded CI runner, another test on the other xdist worker) adds to any probe at that
moment, so a test bounds pdproxy's ``/health`` above what the control took, not absolutely.
"""

from __future__ import annotations

import asyncio
import sys

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


if __name__ == "__main__":
    asyncio.run(main())
