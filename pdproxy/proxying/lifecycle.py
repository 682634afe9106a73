"""Readiness and graceful drain.

Ready: at least one prefill and one decode are routable and the proxy is not draining.
Drain (on SIGTERM, see ``pdproxy.runtime.server``): readiness turns false and new requests get 503
at once; requests in flight may finish for ``--shutdown-timeout-secs``; then every stream
still open ends with one terminal SSE error event (its upstream legs closed, so the engines
abort them) and every whole answer still awaited is answered 503. Only then does the
server stop, in uvicorn's order: listener, connections, lifespan shutdown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from pdproxy.errors import ShuttingDown
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.proxying.relay import ClientStream

logger = logging.getLogger(__name__)

_POLL = 0.05  # seconds between checks of the requests in flight
_AFTERMATH = 5.0  # seconds the ended streams and cancelled requests get to answer


class Lifecycle:
    def __init__(self, registry: EndpointRegistry, in_flight: Callable[[], int]) -> None:
        self._registry = registry
        self._in_flight = in_flight  # client requests being served
        self.draining = False
        self.forced = False  # the grace is over: requests still waiting are cancelled
        self.streams: set[ClientStream] = set()
        self.waiting: set[asyncio.Task[Any]] = set()  # requests not answering yet

    def ready(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining"
        snapshot = self._registry.snapshot()
        if not snapshot.prefill:
            return False, "no routable prefill instance"
        if not snapshot.decode:
            return False, "no routable decode instance"
        return True, "ready"

    async def drain(self, timeout: float) -> None:
        """Stop taking requests, let those in flight finish for ``timeout`` s, end the rest."""
        self.draining = True
        logger.info("draining: %d request(s) in flight, up to %.1f s", self._in_flight(), timeout)
        if not await self._settled(timeout):
            logger.warning("ending %d request(s) still in flight", self._in_flight())
            self.forced = True
            error = ShuttingDown("pdproxy is shutting down")
            for relay in list(self.streams):
                relay.abort(error)
            for task in list(self.waiting):
                task.cancel()
            await self._settled(_AFTERMATH)
        logger.info("drained")

    async def _settled(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        # A poll, only while shutting down: the count changes on every request's path,
        # where an event per change would cost more than it saves here.
        while self._in_flight() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(_POLL)
        return self._in_flight() == 0
