"""The ZMQ registry socket: vLLM engines' heartbeats in, registry upserts out.

A ROUTER bound on the event loop (``zmq.asyncio``, no threads). Engines connect a DEALER
and send one msgpack dict every 3 s; nothing is ever sent back. With ``zap.py``, the only
modules that import zmq.

Hardening, cheapest check first:

* With ``allow_cidrs``, a ZAP handler admits connections by the peer's IP address; any other
  peer is refused during the handshake and none of its messages ever arrive.
* A frame past ``MAXMSGSIZE`` never arrives: libzmq closes that peer's connection instead.
* A peer (a connection, by its routing id) that sends malformed messages faster than
  ``GarbageLimiter`` allows is muted: its messages are dropped, counted ``outcome="muted"``,
  before anything decodes them. Other peers, valid engines on the same host included, are
  unaffected.
* A bad message (a frame count other than 2, an empty frame, a payload that is oversized or
  does not decode) is counted as ``outcome="malformed"``, logged rate-limited, and dropped.

Queued messages are handled in batches bounded in count and time, yielding to the loop
between them, so a flood delays HTTP traffic by one batch (1 ms) at most. An unexpected
exception from receiving or handling is logged with its traceback, counted as
``outcome="error"``, and the loop resumes after a bounded backoff: discovery never stops
silently. Only cancellation (``aclose``) ends it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import zmq
import zmq.asyncio
from prometheus_client import Counter

from pdproxy.config.registry import RegistryConfig
from pdproxy.errors import RegistryMessageError
from pdproxy.membership.discovery.messages import decode
from pdproxy.membership.discovery.zap import ZapAllowList, parse_networks
from pdproxy.membership.membership import Membership
from pdproxy.observability.log import RateLimitedLogger
from pdproxy.observability.metrics import ProxyMetrics

logger = logging.getLogger(__name__)

# Per connection: while we fall behind, libzmq queues at most this many messages (each at
# most max_message_bytes, so 6.4 MiB by default), then stops reading that peer's socket.
# An engine sends one every 3 s; at 1,000 a flood of 32 KiB messages grew RSS by 50 MiB.
_RECV_HWM = 100
# A receive turn handles at most _BATCH queued messages or _TURN seconds of work, whichever
# comes first, then yields: a flood (costly garbage included) delays HTTP traffic by 1 ms at
# most, instead of holding the loop for as long as messages keep coming.
_BATCH, _TURN = 256, 0.001
_BACKOFF_MIN, _BACKOFF_MAX = 0.1, 5.0  # seconds between restarts after unexpected errors
_ZAP_DOMAIN = b"pdproxy-registry"

_T = TypeVar("_T")


class GarbageLimiter:
    """Per-peer token buckets of malformed messages; a peer whose bucket runs dry is muted.

    A peer may send ``burst`` units of garbage at once and ``rate`` units a second after
    that, so a burst is only counted and logged and a sustained flood is muted. A malformed
    message weighs 1 plus 1 per full KiB: large garbage, the costly kind to decode, runs dry
    sooner. One unit more mutes the peer for ``mute_for`` seconds, and its bucket restarts
    empty afterwards. Only peers that sent garbage are tracked; each table holds at most
    ``max_peers`` entries and drops its stalest first, and a bucket untouched long enough to
    be full again is forgotten.
    """

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        rate: float = 50.0,
        burst: float = 5_000.0,
        mute_for: float = 10.0,
        max_peers: int = 4_096,
    ) -> None:
        self.rate, self.burst, self.mute_for = rate, burst, mute_for
        self._clock = clock
        self._max_peers = max_peers
        self._forget_after = burst / rate
        self._buckets: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # (tokens, at)
        self._muted: OrderedDict[bytes, float] = OrderedDict()  # until, soonest first

    def __len__(self) -> int:
        return len(self._buckets) + len(self._muted)

    def muted(self, peer: bytes) -> bool:
        until = self._muted.get(peer)
        if until is None:
            return False
        if self._clock() < until:
            return True
        del self._muted[peer]
        return False

    def strike(self, peer: bytes, weight: float) -> bool:
        """Charge a malformed message of ``weight`` units to ``peer``; True if that mutes it."""
        now = self._clock()
        last = self._buckets.pop(peer, None)
        tokens = self.burst if last is None else last[0] + (now - last[1]) * self.rate
        tokens = min(tokens, self.burst) - weight
        _trim(self._buckets, self._max_peers, lambda b: b[1] <= now - self._forget_after)
        self._buckets[peer] = (max(tokens, 0.0), now)
        if tokens >= 0:
            return False
        _trim(self._muted, self._max_peers, lambda until: until <= now)
        self._muted[peer] = now + self.mute_for
        return True


def _trim(table: OrderedDict[bytes, _T], cap: int, stale: Callable[[_T], bool]) -> None:
    """Drop the oldest entries while they are stale, and until one more fits under ``cap``."""
    while table:
        oldest = next(iter(table))
        if len(table) < cap and not stale(table[oldest]):
            return
        del table[oldest]


def _weight(frames: list[bytes]) -> int:
    return 1 + sum(len(frame) for frame in frames[1:]) // 1024


class ZmqRegistry:
    def __init__(
        self, config: RegistryConfig, membership: Membership, metrics: ProxyMetrics
    ) -> None:
        self._config = config
        self._membership = membership
        self._metrics = metrics
        self._log = RateLimitedLogger(logger, time.monotonic)
        self._guard = GarbageLimiter(time.monotonic)
        self._outcomes: dict[str, Counter] = {}
        self._context = zmq.asyncio.Context()
        self._zap = (
            ZapAllowList(self._context, parse_networks(config.allow_cidrs), self._refused)
            if config.allow_cidrs
            else None
        )
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
        if self._zap is not None:
            # The handler is bound before the ROUTER, and enforcement fails closed: no
            # connection is ever let in unchecked.
            self._zap.start()
            sock.setsockopt(zmq.ZAP_DOMAIN, _ZAP_DOMAIN)
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        sock.bind(f"tcp://{self._config.host}:{self._config.port}")
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._socket = sock
        self._task = asyncio.create_task(self._serve(sock), name="pdproxy-zmq-registry")
        self._task.add_done_callback(_report_end)
        allowed = ", ".join(self._config.allow_cidrs) or "any address"
        logger.info("registry listening on %s, for %s", self.endpoint, allowed)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._socket is not None:
            self._socket.close(linger=0)
        if self._zap is not None:
            await self._zap.aclose()
        self._context.term()

    async def _serve(self, sock: zmq.asyncio.Socket) -> None:
        """Receive forever; survive any ``Exception``, so one bad input cannot end discovery."""
        # A plain socket on the same handle, for non-blocking reads.
        queued: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        backoff = _BACKOFF_MIN
        while True:
            try:
                await self._receive_batch(sock, queued)
            except Exception:
                logger.exception("registry: receive loop failed; resuming in %.1f s", backoff)
                self._count("error")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _BACKOFF_MAX)
            else:
                backoff = _BACKOFF_MIN

    async def _receive_batch(self, sock: zmq.asyncio.Socket, queued: zmq.Socket[bytes]) -> None:
        """Wait for one message, then handle those already queued within the turn's bounds.

        An awaited recv returns without yielding to the loop when a message is queued, so
        under a flood only the explicit yield after a bounded turn lets HTTP traffic run.
        """
        frames = await sock.recv_multipart()
        self._count(self._handle(frames))
        ends = time.perf_counter() + _TURN
        for _ in range(_BATCH - 1):
            try:
                frames = queued.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return  # the next recv waits, and so yields
            self._count(self._handle(frames))
            if time.perf_counter() > ends:
                break
        await asyncio.sleep(0)

    def _count(self, outcome: str) -> None:
        """Hot under a flood: label children are cached, as ``labels()`` takes a lock."""
        child = self._outcomes.get(outcome)
        if child is None:
            child = self._outcomes[outcome] = self._metrics.registry_messages.labels(outcome)
        child.inc()

    def _handle(self, frames: list[bytes]) -> str:
        peer = frames[0]  # ROUTER prepends the peer's routing id
        if self._guard.muted(peer):
            return "muted"
        outcome = self._apply(frames)
        if outcome == "malformed" and self._guard.strike(peer, _weight(frames)):
            self._metrics.registry_mutes.inc()
            self._log.warning(
                "muted",
                "registry: muted peer %s for %.0f s: malformed messages past %.0f a second",
                peer[:16].hex(),
                self._guard.mute_for,
                self._guard.rate,
            )
        return outcome

    def _apply(self, frames: list[bytes]) -> str:
        # A DEALER's single-frame message arrives as 2, with the routing id.
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
        except Exception as exc:  # decode's own bug: still this message's, never the batch's
            self._log.warning(
                "malformed", "registry: dropped a message that failed to decode (%s)", _kind(exc)
            )
            return "malformed"
        if registration is None:
            return "ignored"
        problem = self._config.registration_problem(registration.address)
        if problem is not None:
            self._log.warning("malformed", "registry: dropped a registration: %s", problem)
            return "malformed"
        try:
            return self._membership.heartbeat(registration)
        except Exception:  # one bad entry must not stop registration for everyone
            logger.exception("registry: failed to apply a registration")
            return "error"

    def _refused(self, address: str) -> None:
        self._metrics.registry_refused.inc()
        self._log.warning(
            "refused",
            "registry: refused a connection from %s, outside --registry-allow-cidr",
            address[:64],
        )


def _report_end(task: asyncio.Task[None]) -> None:
    """The serve loop only ends by cancellation; anything else must not pass silently."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("registry: serve loop stopped", exc_info=task.exception())


def _kind(exc: BaseException) -> str:
    return type(exc).__name__
