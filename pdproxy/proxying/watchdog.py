"""One timer that ends the relayed streams whose engine fell silent (``StreamWatchdog``),
and the per-stream size limits the relays read from it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

from pdproxy.errors import ProxyError, UpstreamTimeout


class Watched(Protocol):
    """What the watchdog reads of a stream (``pdproxy.proxying.relay.StreamRelay``)."""

    origin: str | None  # the decode's URL
    last_activity: float  # the watchdog's clock when its engine last sent bytes

    def abort(self, failure: ProxyError) -> None: ...


class StreamWatchdog:
    """Aborts streams whose engine stayed silent longer than ``idle_timeout``.

    One timer for all streams, checked every ``interval``, instead of a timer re-armed on
    every chunk of every stream: a stream's only per-chunk cost is stamping its clock.
    """

    def __init__(
        self,
        idle_timeout: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_event: int = 4 << 20,
        max_stream: int = 1 << 30,
    ) -> None:
        self.idle_timeout = idle_timeout
        # bytes of one SSE event of a stream, and of a whole stream
        self.max_event = max_event
        self.max_stream = max_stream
        self.clock = clock
        self.interval = min(1.0, idle_timeout / 4)
        self._streams: set[Watched] = set()
        self._task: asyncio.Task[None] | None = None

    def watch(self, relay: Watched) -> None:
        self._streams.add(relay)

    def forget(self, relay: Watched) -> None:
        self._streams.discard(relay)

    def abort_from(self, origin: str, failure: ProxyError) -> int:
        """Abort every stream read from the decode ``origin`` (a drain that migrates them:
        each is continued elsewhere if it may be); returns how many."""
        streams = [r for r in self._streams if r.origin == origin]
        for relay in streams:
            relay.abort(failure)
        return len(streams)

    def sweep(self) -> None:
        deadline = self.clock() - self.idle_timeout
        for relay in [r for r in self._streams if r.last_activity < deadline]:
            self.forget(relay)
            relay.abort(
                UpstreamTimeout(f"decode engine silent for {self.idle_timeout:g} s", leg="decode")
            )

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.sweep()

    def start(self) -> None:
        """Sweep in a task of the running loop until ``aclose``."""
        self._task = asyncio.create_task(self.run())

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
