"""pdproxy's client-facing HTTP/1.1 protocol: uvicorn's httptools protocol, bounded.

uvicorn's ``HttpToolsProtocol`` has no bound on a request head (httptools builds a long
header value by concatenation, quadratic in the number of reads), no deadline on a head
before the first response or on a body, and no cap on connections. ``HardenedProtocol``
adds them below ASGI, before any of pdproxy's own work (docs/security.md, "Client
connections and request heads", is the contract):

- Head size: bytes are counted in ``data_received`` from the start of each head until its
  headers complete; past ``max_head_bytes`` (or ``max_headers`` fields) 431. Of a read that
  crosses the bound only the bytes within it are parsed first (a small head may end there,
  before a large body); no byte past the bound is ever parsed.
- Deadlines: a head must be whole ``header_timeout`` after the connect or the previous
  response (408 if part of it came, else a silent close); a body with no progress for
  ``body_timeout`` while pdproxy reads it ends the connection (408 if unanswered). One
  timer per connection checks them, ticking only while a head or body is awaited.
- Connections: past ``max_connections`` the spare connection that waited longest (idle,
  then a stalled body) is closed; with none spare the new one may send one request, a
  probe (``PROBE_PATHS``) is answered and anything else gets 503 with Retry-After.
- Refusals end gracefully (answer, FIN, input dropped until the client closes or
  ``LINGER`` passes), so the client reads the answer before any reset.

The request/response cycle stays uvicorn's ``RequestResponseCycle`` (``pdproxy.api.direct``
checks its type); each one is marked (``LOST_HOOK``) so that a handler can be told of the
connection's loss before its response is complete (``direct.when_lost``). Per request the
cost is a few attribute updates and a clock read; per read of a head, a few comparisons;
nothing per header field or streamed chunk.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, ClassVar

import httptools
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from pdproxy.api.direct import LOST_HOOK
from pdproxy.config.listener import ClientLimits
from pdproxy.errors import (
    BadRequest,
    ClientTimeout,
    HeadTooLarge,
    ProxyError,
    TooManyConnections,
)
from pdproxy.runtime.connection_cap import UNLIMITED_FILES_CAP, connection_cap
from pdproxy.runtime.raw_response import error_bytes

logger = logging.getLogger(__name__)

# A refused connection stays open this long after its answer, or until the client ends it.
LINGER = 1.0
# Deadlines are checked this often (a quarter of the shorter timeout if less), by one timer
# per connection that runs only while a head or a body is awaited: no timer per request.
TICK = 1.0
# Past the cap with every connection busy: these paths are still served, on at most
# OVER_CAP_WAITING connections waiting for their request (past that the oldest gets 503).
PROBE_PATHS = (b"/health", b"/ready")
OVER_CAP_WAITING = 32
WARN_EVERY = 10.0  # seconds between two warnings that the cap turned clients away


def hardened_protocol(limits: ClientLimits) -> type[HardenedProtocol]:
    """The protocol class uvicorn instantiates per connection (``uvicorn.Config(http=...)``),
    carrying ``limits`` and the connection cap resolved in this process."""
    cap = connection_cap(limits)

    class Configured(HardenedProtocol):
        client_limits = limits
        max_connections = cap
        tick = min(TICK, limits.header_timeout / 4, limits.body_timeout / 4)
        refusals = Refusals()

    return Configured


class Refusals:
    """503s at the cap: one warning per ``WARN_EVERY`` seconds at most (one per server)."""

    def __init__(self) -> None:
        self.count = 0
        self.warned_at = float("-inf")

    def add(self, now: float, cap: int) -> None:
        self.count += 1
        if now - self.warned_at >= WARN_EVERY:
            message = "%d client request(s) got 503: all %d client connections busy"
            logger.warning(message + " (--max-client-connections)", self.count, cap)
            self.count, self.warned_at = 0, now


class HardenedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds of the module docstring."""

    client_limits: ClassVar[ClientLimits] = ClientLimits()
    max_connections: ClassVar[int] = UNLIMITED_FILES_CAP
    tick: ClassVar[float] = TICK
    refusals: ClassVar[Refusals]  # one per server: hardened_protocol sets it

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._in_head = True  # waiting for a head, or reading one: its bytes are counted
        self._head_bytes = 0
        self._body_pending = False  # headers complete, the message not yet
        self._body_moved = False  # some body came since the last tick
        self._quiet_since = -1.0  # the body's last progress seen by a tick (-1: none yet)
        self._ended = False  # refused or timed out: nothing more is parsed
        self._over_cap = False  # every connection was busy: a probe is served, else 503
        self._max_headers = self.client_limits.max_headers
        # The next head's deadline: set at the connect and at each response's end, so it
        # also orders idle connections by age.
        self._deadline = 0.0
        self._ticker: asyncio.TimerHandle | None = None

    # connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline = self.loop.time() + self.client_limits.header_timeout
        if len(self.connections) > self.max_connections:
            self._make_room()
        self._arm_tick()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._cancel_tick()
        cycle = self.cycle
        if cycle is not None and cycle.disconnected:  # the response was unfinished
            lost = getattr(cycle, LOST_HOOK, None)
            if lost is not None:
                setattr(cycle, LOST_HOOK, None)
                lost()

    def _make_room(self) -> None:
        """Past the cap (closing and refused connections not counted), close the spare one
        that waited longest (idle first, then a stalled body); with none, this one is over
        the cap, and past ``OVER_CAP_WAITING`` such ones the oldest of them gets 503."""
        live, waiting, victim, best = 1, [], None, (0, 0.0)
        for other in self.connections:
            if not isinstance(other, HardenedProtocol):
                live += 1
            elif other is self or other._ended or other.transport.is_closing():
                continue
            elif other._over_cap:
                waiting.append(other)
            else:
                live += 1
                rank = (other._spare(), -other._deadline)
                if rank[0] and rank > best:
                    victim, best = other, rank
        if live <= self.max_connections:
            return
        if victim is not None:
            logger.debug("closing a spare client connection to make room for a new one")
            victim._evict()
            return
        self._over_cap = True
        if len(waiting) >= OVER_CAP_WAITING:
            min(waiting, key=lambda c: c._deadline)._refuse_past_cap()

    def _spare(self) -> int:
        """2: no request in progress (between two, or a head still coming); 1: its body
        made no progress for a tick while pdproxy was reading it; 0: busy."""
        if self._idle():
            return 2
        return 1 if self._body_pending and self._body_quiet(self.tick) else 0

    def _evict(self) -> None:
        if self._idle():
            self._close()
        else:
            self._end_stalled_body()

    def _refuse_past_cap(self) -> None:
        self.refusals.add(self.loop.time(), self.max_connections)
        self._end(TooManyConnections("every client connection is busy; retry shortly"))

    def _idle(self) -> bool:
        """No request in progress: between two, or a head still coming."""
        cycle = self.cycle
        return (cycle is None or cycle.response_complete) and not self.pipeline

    # reads

    def data_received(self, data: bytes) -> None:
        if not self._in_head:
            super().data_received(data)
        elif self._ended:  # answered: what still comes is dropped
            return
        else:
            room = self.client_limits.max_head_bytes - self._head_bytes
            self._head_bytes += len(data)
            if len(data) > room:
                self._read_past_bound(data, room)
                return
            super().data_received(data)
            if self._in_head and len(self.headers) > self._max_headers and not self._ended:
                self._refuse_head()  # at once, not at the byte bound

    def _read_past_bound(self, data: bytes, room: int) -> None:
        """The head ends within the ``room`` bytes left (the rest is read as usual), or it
        is refused without parsing a byte more."""
        super().data_received(data[:room])
        if self._ended or self.transport.is_closing():
            return
        if self._in_head and self._head_bytes:  # the same head (a new one starts at 0)
            self._refuse_head()
            return
        self.data_received(data[room:])

    def on_headers_complete(self) -> None:
        if self._ended:
            return
        self._in_head, self._quiet_since = False, -1.0
        if len(self.headers) > self._max_headers:
            self._refuse_head()
            return
        self._body_pending = True
        if self._over_cap:
            self._probe_or_refuse()
            return
        super().on_headers_complete()
        if self.cycle is not None:  # connection_lost calls what its handler sets here
            setattr(self.cycle, LOST_HOOK, None)

    def _probe_or_refuse(self) -> None:
        """Past the cap only a probe is served (an orchestrator must not read a full
        proxy as a dead one), then the connection closes."""
        if self.url.partition(b"?")[0] not in PROBE_PATHS:
            self._refuse_past_cap()
            return
        super().on_headers_complete()
        self.cycle.keep_alive = False

    def on_body(self, body: bytes) -> None:
        if self._ended:
            return
        self._body_moved = True
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self._ended:
            return
        super().on_message_complete()
        self._in_head, self._head_bytes, self._body_pending = True, 0, False

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a head httptools cannot parse, as JSON (its own is text)."""
        if self._ended:  # the connection already has its answer
            return
        if self._busy():
            self._close()
        else:
            self._end(BadRequest("invalid HTTP request"))

    # deadlines

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._ended or self.transport.is_closing():
            return
        self._deadline = self.loop.time() + self.client_limits.header_timeout
        if self._ticker is None:  # it stops while a request is answered
            self._arm_tick()

    def _busy(self) -> bool:
        return not self._idle()

    def _arm_tick(self) -> None:
        self._ticker = self.loop.call_later(self.tick, self._on_tick)

    def _cancel_tick(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None

    def _on_tick(self) -> None:
        """Check what is awaited; stop while a request is answered (its end re-arms)."""
        self._ticker = None
        if self._ended or self.transport.is_closing():
            return
        if self._in_head:
            if self._busy():  # a head after a request still answered (pipelined)
                return
            if self.loop.time() >= self._deadline:
                self._head_timed_out()
                return
        elif not self._body_pending or self._body_stalled():
            return
        self._arm_tick()

    def _head_timed_out(self) -> None:
        if self._head_bytes:
            logger.debug("a client's request head took too long: 408")
            self._end(ClientTimeout("request head not received in time"))
        else:
            self._close()

    def _body_stalled(self) -> bool:
        """A tick in a body: True when it made no progress for ``body_timeout`` (the
        connection is then ended); time when pdproxy itself is not reading does not count."""
        if self._body_moved or self._quiet_since < 0 or not self._reading_body():
            self._body_moved, self._quiet_since = False, self.loop.time()
            return False
        if self.loop.time() - self._quiet_since < self.client_limits.body_timeout:
            return False
        self._end_stalled_body()
        return True

    def _reading_body(self) -> bool:
        """Else the silence is pdproxy's: flow control paused reading, or 100 Continue owed."""
        return not self.flow.read_paused and not self.cycle.waiting_for_100_continue

    def _body_quiet(self, seconds: float) -> bool:
        """No body came for ``seconds`` or more (as the ticks saw it) while pdproxy read."""
        return (
            not self._body_moved
            and self._quiet_since >= 0
            and self._reading_body()
            and self.loop.time() - self._quiet_since >= seconds
        )

    def _end_stalled_body(self) -> None:
        logger.debug("a client's request body stalled: closing its connection")
        if self.cycle.response_started:
            self._close()
        else:
            self._end(ClientTimeout("request body stalled"))

    # refusals

    def _refuse_head(self) -> None:
        logger.debug("a client's request head is past the bounds: 431")
        self._release_head()
        if self._busy():  # an earlier response is still being written: no answer fits
            self._close()
            return
        limits = self.client_limits
        self._end(
            HeadTooLarge(
                f"request head over {limits.max_head_bytes} bytes or {limits.max_headers} fields"
            )
        )

    def _end(self, error: ProxyError) -> None:
        """Answer ``error`` and close gracefully (module docstring); nothing more is parsed."""
        self._stop()
        transport = self.transport
        transport.write(error_bytes(error, self.server_state.default_headers))
        if not transport.can_write_eof():  # TLS: its close sends close_notify after the answer
            transport.close()
            return
        transport.write_eof()
        self.flow.resume_reading()  # to see the client's own end, or what it still sends
        self.loop.call_later(LINGER, transport.close)

    def _close(self) -> None:
        """Close without an answer; nothing more is read."""
        self._stop()
        self.transport.close()

    def _stop(self) -> None:
        self._ended, self._in_head, self._body_pending = True, True, False
        self._cancel_tick()

    def _release_head(self) -> None:
        """A refused head (never the app's) is dropped now, not when the socket closes."""
        self.headers.clear()
        self.url = b""
        self.parser = httptools.HttpRequestParser(self)
