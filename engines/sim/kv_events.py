"""KV cache events in vLLM's wire format (``vllm/distributed/kv_events.py``), with faults.

As ``ZmqEventPublisher``: a PUB socket sends ``(topic, seq as 8 bytes big-endian,
msgpack batch)``, numbered from 0; a ROUTER replay socket answers a request carrying a
start number with ``(id, b"", topic, seq, batch)`` for each buffered batch from there, then
``(id, b"", b"", -1, b"")``. A batch is ``[ts, [events], dp_rank]``; events are tagged maps
(``encoding="map"``, vLLM 0.32) or tagged positional arrays (``"array"``, earlier releases).

Faults (``KVFaults``, settable at any time): drop the next N batches (numbered, never
sent: a gap), restart the numbering at 0 (a restarted engine), stop publishing, and stop
answering replays. Runs on the event loop (``zmq.asyncio``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(slots=True)
class KVFaults:
    drop_batches: int = 0  # the next N batches are numbered but never sent
    stopped: bool = False  # nothing is published (numbers do not advance)
    replay: bool = True  # the replay socket answers


def stored(
    hashes: Sequence[int],
    parent: int | None,
    token_ids: Sequence[int],
    block_size: int,
    encoding: str,
    *,
    lora_name: str | None = None,
    extra_keys: list[Any] | None = None,
) -> Any:
    if encoding == "array":
        return ["BlockStored", list(hashes), parent, list(token_ids), block_size, None, "GPU"]
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(token_ids),
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": lora_name,
    }
    if extra_keys is not None:
        event["extra_keys"] = extra_keys
    return event


def removed(hashes: Sequence[int], encoding: str) -> Any:
    if encoding == "array":
        return ["BlockRemoved", list(hashes), "GPU"]
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}


def cleared(encoding: str) -> Any:
    return ["AllBlocksCleared"] if encoding == "array" else {"type": "AllBlocksCleared"}


class KVEventPublisher:
    """Binds ``endpoint`` (PUB) and ``replay_endpoint`` (ROUTER, optional); ``tcp://host:0``
    binds a free port (``endpoint``/``replay_endpoint`` then name it)."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        encoding: str = "map",
        topic: str = "",
        dp_rank: int = 0,
        buffer_steps: int = 10_000,
    ) -> None:
        if encoding not in ("map", "array"):
            raise ValueError("encoding is 'map' or 'array'")
        self.encoding = encoding
        self.faults = KVFaults()
        self._topic = topic.encode()
        self._rank = dp_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._context = zmq.asyncio.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = _bind(self._pub, endpoint)
        self._router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        self._task: asyncio.Task[None] | None = None
        if replay_endpoint is not None:
            self._router = self._context.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = _bind(self._router, replay_endpoint)

    def start(self) -> None:
        if self._router is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replays())

    def publish(self, events: list[Any]) -> None:
        """One batch (nothing when ``events`` is empty or publishing is stopped)."""
        if not events or self.faults.stopped:
            return
        seq = self._seq
        self._seq += 1
        payload = msgpack.packb([time.time(), events, self._rank])
        self._buffer.append((seq, payload))
        if self.faults.drop_batches > 0:
            self.faults.drop_batches -= 1
            return
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)

    def publish_raw(self, payload: bytes) -> None:
        """A numbered batch whose payload is ``payload`` as it is (a hostile publisher's)."""
        seq = self._seq
        self._seq += 1
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)

    def restart_sequence(self) -> None:
        """As a restarted engine: numbers from 0, an empty replay buffer."""
        self._seq = 0
        self._buffer.clear()

    async def _serve_replays(self) -> None:
        assert self._router is not None
        router = self._router
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or not self.faults.replay:
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await router.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
            await router.send_multipart((client, b"", b"", END_SEQ, b""))

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)
        self._context.term()


def _bind(sock: zmq.asyncio.Socket, endpoint: str) -> str:
    if endpoint.endswith(":0"):
        port = sock.bind_to_random_port(endpoint[: -len(":0")])
        return f"{endpoint[: -len(':0')]}:{port}"
    sock.bind(endpoint)
    return endpoint
