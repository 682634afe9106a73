"""pdproxy's Python per streamed token, in process: one engine read of one SSE chunk through
the legs' connection (``Connection.data_received``, httptools), the answer's push, the
relay (``StreamRelay``) and a direct writer like ``pdproxy.api.direct``'s into a transport
that only counts its writes (no socket: the kernel's share is ``bench.cpu_split``'s).

    python -m bench.relay_micro [--tokens 200000]

Printed: process CPU time per token, plain and with a migratable stream's kept bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from pdproxy.proxying.relay import ClientStream, StreamRelay
from pdproxy.proxying.resumable import ResumableStream
from pdproxy.proxying.watchdog import StreamWatchdog
from pdproxy.upstream.engine_client import UpstreamResponse
from pdproxy.upstream.http1.connection import Connection
from pdproxy.upstream.http1.response import Response

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
# one token's event as the sims (and vLLM) write it
EVENT = (
    b'data: {"id":"cmpl-64a75eaa9bc043619f5196b0ee50ad99","object":"text_completion",'
    b'"created":1796219893,"model":"sim-model","choices":[{"index":0,"text":" fox",'
    b'"logprobs":null,"finish_reason":null,"stop_reason":null}],"usage":null}\n\n'
)


class _Transport:
    """Counts writes; what an asyncio transport is asked for on this path."""

    def __init__(self) -> None:
        self.writes = 0

    def write(self, data: bytes) -> None:
        self.writes += 1

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Pool:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def release(self, connection: Connection) -> None:
        pass

    def discard(self, connection: Connection) -> None:
        pass

    def lost(self, connection: Connection) -> None:
        pass


async def per_token_us(tokens: int, migratable: bool) -> float:
    """Process CPU microseconds per token over ``tokens`` engine reads."""
    loop = asyncio.get_running_loop()
    connection = Connection(_Pool(loop), (False, "engine", 1))
    connection.connection_made(_Transport())  # type: ignore[arg-type]
    response = Response(connection, None, post=True, limit=1 << 20)
    connection.send(b"", response)
    connection.data_received(HEAD)
    upstream = UpstreamResponse(200, "text/event-stream", "decode", "http://e:1", response, None)
    plain = StreamRelay(upstream, lambda: None, StreamWatchdog(60.0))
    relay: ClientStream = plain
    if migratable:
        relay = ResumableStream(plain, _no_resume, lambda events: True)
    client = _Transport()

    def write(chunk: bytes) -> bool:  # pdproxy.api.direct's writer, less uvicorn's flags
        client.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        return True

    relay.relay_directly(write)
    read = b"%x\r\n%b\r\n" % (len(EVENT), EVENT)
    received = connection.data_received
    started = time.process_time()
    for _ in range(tokens):
        received(read)
    spent = time.process_time() - started
    assert client.writes == tokens, client.writes  # every token went straight through
    relay.close()
    return 1e6 * spent / tokens


async def _no_resume(delivered: bytes, failure: Exception) -> None:
    return None


async def main_async(tokens: int) -> None:
    plain = await per_token_us(tokens, migratable=False)
    kept = await per_token_us(tokens, migratable=True)
    print(f"pdproxy's Python per streamed token: {plain:.2f} µs; migratable stream: {kept:.2f} µs")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=200_000)
    asyncio.run(main_async(p.parse_args(argv).tokens))


if __name__ == "__main__":
    main()
