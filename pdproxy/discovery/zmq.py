"""The ZMQ registry socket: vLLM engines' heartbeats in, registry upserts out.

A ROUTER bound on the event loop (``zmq.asyncio``, no threads). Engines connect a DEALER
and send one msgpack dict every 3 s; nothing is ever sent back. The only module that
imports zmq.

A bad message (a frame count other than 2, an empty frame, a payload that is oversized or
does not decode) is counted as ``outcome="malformed"``, logged rate-limited, and dropped; a
frame past ``MAXMSGSIZE`` never arrives, libzmq closes that peer's connection instead. An
unexpected exception from receiving or handling is logged with its traceback, counted as
``outcome="error"``, and the loop resumes after a bounded backoff: discovery never stops
silently. Only cancellation (``aclose``) ends it.
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
_BACKOFF_MIN, _BACKOFF_MAX = 0.1, 5.0  # seconds between restarts after unexpected errors


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
        self._task = asyncio.create_task(self._serve(sock), name="pdproxy-zmq-registry")
        self._task.add_done_callback(_report_end)
        logger.info("registry listening on %s", self.endpoint)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._socket is not None:
            self._socket.close(linger=0)
        self._context.term()

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        """Receive forever; survive any ``Exception``, so one bad input cannot end discovery."""
        backoff = _BACKOFF_MIN
        while True:
            try:
                await self._receive_one(sock)
            except Exception:
                logger.exception("registry: receive loop failed; resuming in %.1f s", backoff)
                self._metrics.registry_messages.labels("error").inc()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX)
            else:
                backoff = _BACKOFF_MIN

    async def _receive_one(self, sock: zmq.asyncio.Socket) -> None:
        frames = await sock.recv_multipart()
        outcome = self._handle(frames)
        self._metrics.registry_messages.labels(outcome).inc()

    def _handle(self, frames: list[bytes]) -> str:
        # ROUTER prepends the peer identity: a DEALER's single-frame message arrives as 2.
        if len(frames) != 2:
            self._log.warning("frames", "registry: dropped a message of %d frames", len(frames))
            return "malformed"
        if not frames[1]:
            self._log.warning("empty", "registry: dropped an empty message")
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


def _report_end(task: asyncio.Task[None]) -> None:
    """The serve loop only ends by cancellation; anything else must not pass silently."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("registry: serve loop stopped", exc_info=task.exception())
