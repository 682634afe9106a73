"""Active health checks: ``GET /health`` on every instance, whatever its source.

Every ``--health-check-interval-secs`` all instances are probed at once on the probe pool
(never the legs' pool), each within ``--health-check-timeout-secs``; the health book
(``resilience.outlier``, where active and passive health meet) turns the results into
verdicts. A new instance is probed as soon as it is admitted and is routable only once it
answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from pdproxy.config.resilience import HealthConfig
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.resilience.outlier import OutlierDetector
from pdproxy.types import Endpoint, ProbeState
from pdproxy.upstream.engine_client import EngineClient

logger = logging.getLogger(__name__)

_RECHECK_AFTER = 0.5  # seconds; the most an unhealthy instance that answered waits to be rechecked


class HealthChecker:
    def __init__(
        self,
        config: HealthConfig,
        *,
        registry: EndpointRegistry,
        client: EngineClient,
        outliers: OutlierDetector,
    ) -> None:
        self.config = config
        self._registry = registry
        self._client = client
        self._outliers = outliers
        self._task: asyncio.Task[None] | None = None
        self._pending: dict[str, asyncio.Task[None]] = {}  # out-of-round probe per instance
        self._tasks: set[asyncio.Task[None]] = set()  # every out-of-round probe, for aclose

    def start(self) -> None:
        if self.config.enabled:
            self._task = asyncio.create_task(self._run())

    async def aclose(self) -> None:
        tasks = [t for t in (self._task, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def admitted(self, endpoint: Endpoint) -> None:
        """A new instance: not routable until its first probe answers, which starts now."""
        if not self.config.enabled:
            return
        self._outliers.probing(endpoint)
        self._spawn(endpoint, self.check(endpoint))

    async def settle(self) -> None:
        """Wait for the first probes of the instances admitted so far (start-up)."""
        await asyncio.gather(*self._pending.values(), return_exceptions=True)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(e) for e in self._registry.all()))

    async def check(self, endpoint: Endpoint) -> None:
        ok = await self._client.probe(endpoint.url + self.config.endpoint, self.config.timeout)
        if self._registry.get(endpoint.url) is endpoint:  # not replaced or removed meanwhile
            self.record(endpoint, ok)

    def record(self, endpoint: Endpoint, ok: bool) -> None:
        before = endpoint.health.probe
        after = self._outliers.on_probe(endpoint, ok, self.config)
        if after is None:
            if ok and before is ProbeState.UNHEALTHY:
                self._recheck_soon(endpoint)
            return
        self._registry.invalidate()
        log = logger.info if after is ProbeState.HEALTHY else logger.warning
        log("%s %s is %s (health checks)", endpoint.role.value, endpoint.url, after.value)

    def _recheck_soon(self, endpoint: Endpoint) -> None:
        """An unhealthy instance answered: confirm it within a fraction of the interval
        rather than a whole one per success, so a recovered instance is back within about
        one interval whatever ``success_threshold`` is."""
        self._spawn(endpoint, self._recheck(endpoint))

    async def _recheck(self, endpoint: Endpoint) -> None:
        await asyncio.sleep(min(_RECHECK_AFTER, self.config.interval / 4))
        self._pending.pop(endpoint.url, None)  # its verdict may schedule the next recheck
        await self.check(endpoint)

    def _spawn(self, endpoint: Endpoint, probe: Coroutine[Any, Any, None]) -> None:
        """Run one out-of-round probe of ``endpoint``, at most one at a time."""
        if endpoint.url in self._pending:
            probe.close()
            return
        task = asyncio.create_task(probe)
        self._pending[endpoint.url] = task
        self._tasks.add(task)

        def done(_: asyncio.Task[None]) -> None:
            self._tasks.discard(task)
            if self._pending.get(endpoint.url) is task:
                del self._pending[endpoint.url]

        task.add_done_callback(done)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval)
            try:
                await self.check_all()
            except Exception:  # the checker must outlive any one bad probe
                logger.exception("health check round failed")
