"""The KV side channel: a tiny length-prefixed msgpack protocol over TCP.

Each frame is a 4-byte big-endian length and a msgpack map. The decode sends
`{"engine_id", "request_id", "block_ids"}`; the prefill answers `{"ok": true, "blocks": [...]}`
or `{"ok": false, "error": "..."}`. One request per connection. NIXL's decode also sends
`{"op": "release", "engine_id", "request_id"}` (free the blocks of a request it rejected;
answered `{"ok": true}` or an error). The id-embedding connectors add an `op` key (`read`,
`write`, `put`, `pull`) and may answer after a wait (async handler).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack

MAX_FRAME = 256 * 1024 * 1024
ERRORS = (OSError, asyncio.TimeoutError, ValueError, asyncio.IncompleteReadError)  # of request()
Handler = Callable[[dict[str, Any]], "dict[str, Any] | Awaitable[dict[str, Any]]"]


async def read_frame(reader: asyncio.StreamReader) -> dict[str, Any]:
    size = int.from_bytes(await reader.readexactly(4), "big")
    if size > MAX_FRAME:
        raise ValueError(f"frame of {size} bytes is too large")
    msg = msgpack.unpackb(await reader.readexactly(size))
    if not isinstance(msg, dict):
        raise ValueError("frame is not a map")
    return msg


def encode_frame(msg: dict[str, Any]) -> bytes:
    data: bytes = msgpack.packb(msg)
    return len(data).to_bytes(4, "big") + data


async def serve(host: str, port: int, handler: Handler) -> asyncio.Server:
    """Start the side-channel server; handler maps a request frame to a reply frame."""

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await read_frame(reader)
            reply = handler(request)
            if inspect.isawaitable(reply):
                reply = await reply
            writer.write(encode_frame(reply))
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    return await asyncio.start_server(on_client, host, port)


async def request(host: str, port: int, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Send one request frame and return the reply; raises OSError/TimeoutError on failure."""
    return await asyncio.wait_for(_exchange(host, port, msg), timeout)


async def _exchange(host: str, port: int, msg: dict[str, Any]) -> dict[str, Any]:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(encode_frame(msg))
        await writer.drain()
        return await read_frame(reader)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
