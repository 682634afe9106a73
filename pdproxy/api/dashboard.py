"""The live fleet dashboard: ``GET /dashboard`` and its data, ``GET /dashboard/data``.

The page is static files shipped in ``pdproxy/dashboard/`` (HTML, CSS, plain JS, no
build step), served with a Content-Security-Policy that lets it reach its own origin and
nothing else. It holds no data: it polls ``/dashboard/data`` every second, which needs a
client key exactly when ``/metrics`` does (``--protect-metrics``).

The windowed figures are computed here, not in the browser: a sampler records the
cumulative request and TTFT figures from pdproxy's own Prometheus objects every second
into a ``FleetWindow``, so the page (or ``curl``) gets the last minutes at once, with the
same numbers in every tab. Under ``--workers`` every figure is the whole proxy's: the totals
and the in-flight figures are read from the multiprocess files every worker writes
(``pdproxy.observability.workers_view``), so the page is the same from every worker. Reading
every process's counter and histogram files takes milliseconds of the worker's loop, so a
worker records them only while its page is watched (``WATCHED``), not every second for nobody.
``docs/dashboard.md`` documents the JSON.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.samples import Sample

import pdproxy
from pdproxy.api.errors import json_response
from pdproxy.api.info import (
    WholeProxy,
    describe,
    describe_load,
    flow_status,
    model_pools,
    whole_proxy,
)
from pdproxy.api.state import AppState
from pdproxy.errors import Unauthorized
from pdproxy.observability.fleet_view import (
    FleetWindow,
    Totals,
    figures_dict,
    series_dict,
    totals_from_samples,
)
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.observability.workers_view import read_totals_samples
from pdproxy.resilience.outlier import OutlierDetector
from pdproxy.types import ApiKind, Endpoint, EngineLoad

logger = logging.getLogger(__name__)

SCHEMA = 1  # /dashboard/data's schema version; bumped on an incompatible change
SAMPLE_INTERVAL = 1.0  # seconds between two records of the cumulative figures
HISTORY = 300.0  # seconds of records kept: the sparklines' span
WINDOW = 60.0  # seconds the headline figures cover
SERIES_STEP = 2.0  # seconds per sparkline point
WATCHED = 10.0  # --workers: seconds after a /dashboard/data answer the sampler keeps reading

# path under /dashboard -> (file in pdproxy/dashboard/, content type)
ASSETS = {
    "": ("index.html", "text/html; charset=utf-8"),
    "/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
    "/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/dom.js": ("dom.js", "text/javascript; charset=utf-8"),
    "/kv_events.js": ("kv_events.js", "text/javascript; charset=utf-8"),
    "/flow.js": ("flow.js", "text/javascript; charset=utf-8"),
}
# The page may load and fetch from its own origin only; nothing inline, nothing else.
ASSET_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class Dashboard:
    """The dashboard's routes and the sampler feeding its window; built by ``create_app``
    only when the dashboard is on."""

    def __init__(self, state: AppState, clock: Callable[[], float]) -> None:
        self._state = state
        self._clock = clock
        self._started_at = clock()
        self._watched_until = float("-inf")  # --workers: when to stop reading the files
        self.window = FleetWindow(clock, history=HISTORY, interval=SAMPLE_INTERVAL)
        self._task: asyncio.Task[None] | None = None
        files = resources.files("pdproxy") / "dashboard"
        self._assets = {
            path: ((files / name).read_bytes(), media_type)
            for path, (name, media_type) in ASSETS.items()
        }

    def mount(self, app: FastAPI) -> None:
        for path, (body, media_type) in self._assets.items():
            app.add_api_route(
                "/dashboard" + path,
                _static(body, media_type),
                methods=["GET"],
                include_in_schema=False,
            )
        app.add_api_route("/dashboard/data", self._data, methods=["GET"], include_in_schema=False)

    def start(self) -> None:
        if self._state.worker_gauges is None:
            self.sample()
        self._task = asyncio.create_task(self._run())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def watched(self, now: float) -> None:
        """The page asked at ``now``: under ``--workers`` the sampler reads for ``WATCHED``."""
        self._watched_until = now + WATCHED

    def due(self) -> bool:
        """Whether the 1 s sampler records now: always in a single process (its own metric
        objects, microseconds); under ``--workers`` only while the page is watched."""
        return self._state.worker_gauges is None or self._clock() <= self._watched_until

    def sample(self) -> Totals:
        gauges = self._state.worker_gauges
        if gauges is None:
            totals = read_totals(self._state.metrics)
        else:  # --workers: every process's, as /metrics sums them
            totals = read_file_totals(gauges.directory)
        self.window.record(totals)
        return totals

    def data(self) -> dict[str, Any]:
        """The JSON of ``GET /dashboard/data`` (schema in docs/dashboard.md)."""
        state, now = self._state, self._clock()
        self.watched(now)
        totals = self.sample()  # the figures as of this very answer
        endpoints = sorted(state.registry.all(), key=lambda e: (e.role.value, e.url))
        whole = whole_proxy(state)
        rows = [
            instance_row(e, state.outliers, now, load_fresh=state.loads.fresh(e) is not None)
            for e in endpoints
        ]
        return {
            "schema": SCHEMA,
            "proxy": self._proxy(now, whole),
            "instances": whole.count_legs(rows),
            "models": model_pools(state),
            "window": figures_dict(self.window.figures(WINDOW)),
            "series": series_dict(self.window.series(SERIES_STEP), step=SERIES_STEP, span=HISTORY),
            "totals": totals_dict(totals),
            # /status's: the index and each engine rank's events (null: not configured)
            "kv_events": None if state.kv_events is None else state.kv_events.status(),
            # /status's flow section, this process's (null: flow control off)
            "flow": flow_status(state),
        }

    def _proxy(self, now: float, whole: WholeProxy) -> dict[str, Any]:
        state = self._state
        ready, reason = state.lifecycle.ready()
        return {
            "version": pdproxy.__version__,
            "kv_connector": state.config.kv_connector,
            "ready": ready,
            "reason": reason,
            "draining": state.lifecycle.draining,
            "in_flight": whole.in_flight,
            "queue_depth": whole.queue_depth,
            "uptime_seconds": round(now - self._started_at, 3),
            **whole.workers_dict(),
        }

    async def _data(self, request: Request) -> Response:
        state = self._state
        if state.config.protect_metrics and not state.keys.allows(
            request.headers.get("authorization")
        ):
            raise Unauthorized("invalid or missing API key (Authorization: Bearer KEY)")
        response = json_response(self.data())
        response.headers["Cache-Control"] = "no-store"
        return response

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(SAMPLE_INTERVAL)
            if not self.due():
                continue  # --workers, nobody watching: the files' read is not free
            try:
                self.sample()
            except Exception:  # the sampler must outlive any one bad read
                logger.exception("dashboard sample failed")


def _static(body: bytes, media_type: str) -> Callable[[], Awaitable[Response]]:
    async def asset() -> Response:
        return Response(body, media_type=media_type, headers=ASSET_HEADERS)

    return asset


def read_totals(metrics: ProxyMetrics) -> Totals:
    """The cumulative figures, read from the metric objects (never from their text)."""
    generation = tuple(kind.value for kind in ApiKind)
    return totals_from_samples(
        _samples(metrics.requests), _samples(metrics.ttft_seconds), generation
    )


def read_file_totals(directory: str) -> Totals:
    """The cumulative figures of every ``--workers`` process, from the multiprocess files."""
    samples = read_totals_samples(directory, (_REQUESTS, _TTFT))
    generation = tuple(kind.value for kind in ApiKind)
    return totals_from_samples(samples[_REQUESTS], samples[_TTFT], generation)


_REQUESTS = "pdproxy_requests"  # the counter's family, as the files name it (no _total)
_TTFT = "pdproxy_request_ttft_seconds"


def _samples(metric: MetricWrapperBase) -> Iterable[Sample]:
    return [sample for family in metric.collect() for sample in family.samples]


def instance_row(
    endpoint: Endpoint, outliers: OutlierDetector, now: float, *, load_fresh: bool
) -> dict[str, Any]:
    """``/status``'s view of an instance plus its load and ejection, as the page shows it;
    ``load_fresh``: the scheduler still acts on its engine figures."""
    row = describe(endpoint, outliers)
    health = endpoint.health
    ejected_until = health.ejected_until
    row["ejected"] = ejected_until is not None
    row["ejected_for_seconds"] = (
        None if ejected_until is None else round(max(0.0, ejected_until - now), 3)
    )
    row["overloaded"] = health.overloaded_until > now
    row["rank_in_flight"] = list(endpoint.legs.rank_in_flight)
    row["engine_load"] = _engine_load(endpoint.load.engine_load, now, load_fresh)
    return row


def _engine_load(load: EngineLoad | None, now: float, fresh: bool) -> dict[str, Any] | None:
    """``/status``'s rendering of the engine's load, and whether the scheduler still
    trusts it."""
    described = describe_load(load, now)
    return None if described is None else {**described, "fresh": fresh}


def totals_dict(totals: Totals) -> dict[str, Any]:
    """Cumulative figures since pdproxy started; bucket counts are cumulative, and there is
    one more count than bounds (the last is ``+Inf``, the observation count)."""
    buckets = totals.ttft_buckets
    return {
        "requests": dict(sorted(totals.requests.items())),
        "ttft": {
            "count": buckets[-1][1] if buckets else 0.0,
            "sum_seconds": totals.ttft_sum,
            "bucket_bounds": [le for le, _ in buckets[:-1]],
            "bucket_counts": [n for _, n in buckets],
        },
    }
