"""Self-registration with a proxy's ZMQ ROUTER: the exact msgpack payloads vLLM engines send.

Three formats (PROTOCOLS.md 2.1-2.3):

* ``p2p``: ``{"type": "P"|"D", "http_address": "ip:port", "zmq_address": "ip:kv_port"}``
* ``moriio``: the same keys, ``zmq_address = "host:IP,handshake:PORT,notify:PORT"``, plus
  ``dp_size``, ``tp_size`` and ``transfer_mode`` (``"READ"``|``"WRITE"``)
* ``moriio-legacy``: ``{"type": "register", "role": "P"|"D", "request_address":
  "http://ip:port/v1/completions", "handshake_port", "notify_port", "dp_size", "tp_size",
  "transfer_mode"}``

`Heartbeat` sends one payload every interval over a DEALER (no reply is ever expected). The
sim and the `pdproxy-register` sidecar share this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio

log = logging.getLogger("engines.registration")
FORMATS = ("p2p", "moriio", "moriio-legacy")
ROLE_CODES = {"prefill": "P", "decode": "D"}
SEND_TIMEOUT_MS = 1000  # MoRIIO's heartbeat sets SNDTIMEO=1000


@dataclass(frozen=True)
class Registrant:
    """What an engine tells the proxy about itself."""

    role: str  # "P" or "D"
    http_address: str  # "ip:port"
    zmq_address: str  # "ip:port" (p2p) or "host:IP,handshake:PORT,notify:PORT" (moriio)
    dp_size: int = 1
    tp_size: int = 1
    transfer_mode: str = "READ"


def moriio_zmq_address(host: str, handshake_port: int, notify_port: int) -> str:
    return f"host:{host},handshake:{handshake_port},notify:{notify_port}"


def parse_moriio_zmq_address(text: str) -> dict[str, str]:
    """vLLM's parse_moriio_zmq_address: split on ',' then on the first ':'; needs all keys."""
    fields: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition(":")
        if not sep:
            raise ValueError(f"malformed MoRIIO zmq address {text!r}")
        fields[key.strip()] = value.strip()
    missing = [k for k in ("host", "handshake", "notify") if k not in fields]
    if missing:
        raise ValueError(f"MoRIIO zmq address {text!r} lacks {missing}")
    return fields


def build_payload(fmt: str, reg: Registrant) -> dict[str, Any]:
    """The dict a vLLM engine of this connector family sends, for msgpack."""
    if fmt == "p2p":
        return {"type": reg.role, "http_address": reg.http_address, "zmq_address": reg.zmq_address}
    if fmt == "moriio":
        return {
            "type": reg.role,
            "http_address": reg.http_address,
            "zmq_address": reg.zmq_address,
            "dp_size": reg.dp_size,
            "tp_size": reg.tp_size,
            "transfer_mode": reg.transfer_mode,
        }
    if fmt == "moriio-legacy":
        fields = parse_moriio_zmq_address(reg.zmq_address)
        return {
            "type": "register",
            "role": reg.role,
            "request_address": f"http://{reg.http_address}/v1/completions",
            "handshake_port": int(fields["handshake"]),
            "notify_port": int(fields["notify"]),
            "dp_size": reg.dp_size,
            "tp_size": reg.tp_size,
            "transfer_mode": reg.transfer_mode,
        }
    raise ValueError(f"unknown registration format {fmt!r}; known: {FORMATS}")


def proxy_endpoint(address: str) -> str:
    """Accept `tcp://host:port` or bare `host:port`."""
    return address if "://" in address else f"tcp://{address}"


class Heartbeat:
    """Send `payload` to the proxy every `interval_s` on the current loop until stopped.

    `gate` (optional) is awaited before each send; a False answer skips that tick (the
    sidecar's health check). `pause()`/`resume()` stop and restart the pings at run time.
    """

    def __init__(
        self,
        proxy: str,
        payload: dict[str, Any],
        interval_s: float,
        *,
        identity: str | None = None,
        gate: Callable[[], Any] | None = None,
    ) -> None:
        self.proxy = proxy_endpoint(proxy)
        self.payload = payload
        self.interval_s = interval_s
        self.sent = 0
        self.paused = False
        self._identity = identity
        self._gate = gate
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        if self._identity:  # P2P-NCCL sets it to its zmq_address; MoRIIO leaves it random
            sock.setsockopt(zmq.IDENTITY, self._identity.encode())
        sock.connect(self.proxy)
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._run())

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _run(self) -> None:
        data: bytes = msgpack.packb(self.payload)
        while True:
            if not self.paused and (self._gate is None or await self._gate()):
                await self._send(data)
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval_s)

    async def _send(self, data: bytes) -> None:
        if self._sock is None:
            return
        try:
            await self._sock.send(data, zmq.NOBLOCK)
        except zmq.Again:
            log.debug("registration to %s not sent (queue full)", self.proxy)
            return
        except zmq.ZMQError as exc:
            log.warning("registration to %s failed: %s", self.proxy, exc)
            return
        self.sent += 1
