"""Engine load signals: ``GET /metrics`` on every instance, whatever its source.

Every ``--engine-metrics-interval-secs`` all instances are scraped at once on the probe
pool (never the legs' pool), each within the health-check timeout or the interval,
whichever is shorter, and at most ``_MAX_BODY`` bytes; ``engine_stats`` turns each page
into the ``EngineLoad`` kept as ``endpoint.engine_load``, if the endpoint is still the one
in the registry. A failed scrape (unreachable, non-200, too large, not vLLM's gauges) is
counted in ``pdproxy_engine_scrapes_total`` and logged once until the instance answers
again; it never reaches a request and leaves the previous figures in place, which the
scheduler stops trusting once they are older than ``max_age`` (three intervals).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from pdproxy.config.resilience import HealthConfig
from pdproxy.errors import UpstreamError
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.types import Endpoint, EngineLoad
from pdproxy.upstream.engine_client import EngineClient
from pdproxy.wire import engine_stats

logger = logging.getLogger(__name__)

_PATH = "/metrics"
_MAX_CAPACITY = 1_000_000  # a capacity learned above this is an engine's lie, not a figure
_MAX_BODY = 1024 * 1024  # a DP-8 vLLM page is ~0.5 MB; past this it is not a metrics page


class LoadScraper:
    def __init__(
        self,
        config: HealthConfig,
        *,
        registry: EndpointRegistry,
        client: EngineClient,
        metrics: ProxyMetrics,
        clock: Callable[[], float],
    ) -> None:
        self.interval = config.engine_metrics_interval
        # Bounded by the interval too, so one hung engine delays a round by one interval
        # at most and every other instance's figures stay fresh.
        self.timeout = min(config.timeout, self.interval) if self.interval else config.timeout
        self._registry = registry
        self._client = client
        self._metrics = metrics
        self._clock = clock
        self._task: asyncio.Task[None] | None = None
        self._failing: set[str] = set()  # urls whose last scrape failed (logged once)

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    @property
    def max_age(self) -> float:
        """How old figures may be before the scheduler ignores them (0 when off)."""
        return engine_stats.max_age(self.interval)

    def fresh(self, endpoint: Endpoint) -> EngineLoad | None:
        """``endpoint``'s figures if they are recent enough to act on."""
        return engine_stats.fresh_load(endpoint.load.engine_load, self._clock(), self.max_age)

    def start(self) -> None:
        if self.enabled:
            self._task = asyncio.create_task(self._run())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def scrape_all(self) -> None:
        endpoints = self._registry.all()
        self._failing.intersection_update(e.url for e in endpoints)
        await asyncio.gather(*(self.scrape(e) for e in endpoints))

    async def scrape(self, endpoint: Endpoint) -> None:
        """One scrape; never raises for the engine's fault, and leaves the old figures
        in place when it fails."""
        try:
            text = await self._client.get_text(endpoint.url + _PATH, self.timeout, _MAX_BODY)
            load = engine_stats.parse_engine_load(text, self._clock())
        except (UpstreamError, ValueError) as exc:
            self._metrics.count_scrape(ok=False)
            self._failed(endpoint, exc)
            return
        self._metrics.count_scrape(ok=True)
        if self._registry.get(endpoint.url) is not endpoint:  # replaced or removed meanwhile
            return
        apply_load(endpoint, load, self.max_age)
        if endpoint.url in self._failing:
            self._failing.discard(endpoint.url)
            logger.info("%s %s: load figures read again", endpoint.role.value, endpoint.url)

    def _failed(self, endpoint: Endpoint, exc: Exception) -> None:
        if endpoint.url in self._failing or self._registry.get(endpoint.url) is not endpoint:
            return
        self._failing.add(endpoint.url)
        logger.warning(
            "%s %s: cannot read its load from %s (%s); keeping its last figures",
            endpoint.role.value,
            endpoint.url,
            _PATH,
            str(exc)[:200],  # a parse error quotes the engine's page
        )

    async def _run(self) -> None:
        while True:
            try:
                await self.scrape_all()
            except Exception:  # the scraper must outlive any one bad scrape
                logger.exception("engine metrics round failed")
            await asyncio.sleep(self.interval)


def apply_load(endpoint: Endpoint, load: EngineLoad, max_age: float) -> None:
    """``endpoint``'s figures become ``load`` (a scrape's, or under ``--workers`` the
    owner's): the one rule for both.

    The engine's figures include this proxy's own legs; how many there were is noted, so
    the scheduler adds only the others' load to its live count. An engine that had
    requests waiting was running all it can: its running count is a capacity learned
    (``EngineFigures.capacity``, the largest seen), which flow control's leg waits use.
    """
    load = dataclasses.replace(load, own=float(endpoint.legs.in_flight))
    figures = endpoint.load
    figures.engine_load = load
    figures.others, figures.others_until = load.others, load.scraped_at + max_age
    if load.waiting > 0 and load.running >= 1:
        figures.capacity = max(figures.capacity, min(int(load.running), _MAX_CAPACITY))
