"""The ZMQ registry socket: vLLM engines' heartbeats in, registry upserts out.

A ROUTER bound on the event loop (``zmq.asyncio``, no threads). Engines connect a DEALER
and send one msgpack dict every 3 s; nothing is ever sent back. A bad message is counted
and logged (rate-limited) and never stops the loop. The only module that imports zmq.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from pdproxy.config import RegistryConfig
from pdproxy.discovery.messages import decode
from pdproxy.errors import RegistryMessageError
from pdproxy.log import RateLimitedLogger
from pdproxy.membership import Membership
from pdproxy.metrics import ProxyMetrics

logger = logging.getLogger(__name__)

_RECV_HWM = 10_000


class ZmqRegistry:
    def __init__(
        self, config: RegistryConfig, membership: Membership, metrics: ProxyMetrics
    ) -> None:
        self._config = config
        self._membership = membership
        self._metrics = metrics
        self._log = RateLimitedLogger(logger, time.monotonic)
        self._context = zmq.asyncio.Context()
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.endpoint: str | None = None

    def start(self) -> None:
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, _RECV_HWM)
        # P2P-NCCL engines connect with identity = their zmq_address. A restarted engine
        # reconnects with the same identity while its dead connection may linger; without
        # handover the ROUTER would drop the new connection's heartbeats until then.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # libzmq drops a peer that sends a frame larger than this, before it is buffered.
        sock.setsockopt(zmq.MAXMSGSIZE, self._config.max_message_bytes)
        sock.bind(f"tcp://{self._config.host}:{self._config.port}")
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._socket = sock
        self._task = asyncio.create_task(self._serve(sock))
        logger.info("registry listening on %s", self.endpoint)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._socket is not None:
            self._socket.close(linger=0)
        self._context.term()

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart()
            outcome = self._handle(frames)
            self._metrics.registry_messages.labels(outcome).inc()

    def _handle(self, frames: list[bytes]) -> str:
        # ROUTER prepends the peer identity: a DEALER's single-frame message arrives as 2.
        if len(frames) != 2:
            self._log.warning("frames", "registry: dropped a message of %d frames", len(frames))
            return "malformed"
        try:
            registration = decode(frames[1], self._config.max_message_bytes)
        except RegistryMessageError as exc:
            self._log.warning("malformed", "registry: dropped a bad message: %s", exc)
            return "malformed"
        if registration is None:
            return "ignored"
        try:
            return self._membership.heartbeat(registration)
        except Exception:  # one bad entry must not stop registration for everyone
            logger.exception("registry: failed to apply a registration")
            return "error"
