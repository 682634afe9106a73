"""The lean load client of ``bench.workers``: closed-loop keep-alive HTTP/1.1 connections on
raw asyncio streams, pre-encoded requests, only the status line, ``content-length`` and the
chunked framing parsed, so that as much of the machine as possible is left to the proxy.

Each connection sends one request after another until the deadline and records, per answered
request, the seconds from writing the request to its first body byte: the whole (small) answer
for a whole completion, the first SSE chunk for a stream (its time to first token).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import orjson

MODEL = "sim-model"
_PROMPT = "The quick brown fox jumps over the lazy dog " * 4


@dataclass
class Load:
    """What the connections of one phase saw."""

    ok: int = 0
    errors: int = 0
    first_byte: list[float] = field(default_factory=list)  # seconds, one per ok request


def request(port: int, max_tokens: int, *, stream: bool = False) -> bytes:
    body = orjson.dumps(
        {"model": MODEL, "prompt": _PROMPT, "max_tokens": max_tokens, "stream": stream}
    )
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _head(reader: asyncio.StreamReader) -> tuple[bool, int, bool]:
    """(status 200, content-length, chunked) of one answer's head."""
    status = await reader.readline()
    length, chunked = 0, False
    while (line := await reader.readline()) not in (b"\r\n", b""):
        lower = line.lower()
        if lower.startswith(b"content-length:"):
            length = int(line[15:])
        elif lower.startswith(b"transfer-encoding:") and b"chunked" in lower:
            chunked = True
    return status[9:12] == b"200", length, chunked


async def _chunked(reader: asyncio.StreamReader, written: float, load: Load) -> None:
    """Reads a chunked body to its end; its first chunk's arrival is the time to first byte."""
    first = True
    while True:
        size = int((await reader.readline()).split(b";", 1)[0], 16)
        if first:
            load.first_byte.append(time.perf_counter() - written)
            first = False
        await reader.readexactly(size + 2)
        if size == 0:
            return


async def _connection(port: int, payload: bytes, stop: float, load: Load) -> None:
    """One keep-alive connection, one request after another until ``stop``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < stop:
            written = time.perf_counter()
            writer.write(payload)
            ok, length, chunked = await _head(reader)
            if chunked:
                await _chunked(reader, written, load)
            else:
                await reader.readexactly(length)
                load.first_byte.append(time.perf_counter() - written)
            if ok:
                load.ok += 1
            else:
                load.errors += 1
                load.first_byte.pop()
    except (OSError, ValueError, asyncio.IncompleteReadError):
        load.errors += 1
    finally:
        writer.close()


async def closed_loop(port: int, payload: bytes, connections: int, seconds: float) -> Load:
    """``connections`` connections sending ``payload`` back to back for ``seconds``."""
    load = Load()
    stop = time.monotonic() + seconds
    await asyncio.gather(*(_connection(port, payload, stop, load) for _ in range(connections)))
    return load


def quantile(values: list[float], q: float) -> float:
    """The ``q``-quantile (nearest rank) of ``values``; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]
