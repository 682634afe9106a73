"""``/metrics`` across the workers: prometheus_client's multiprocess mode.

Every process (the owner and each worker) writes its series to its own files in the run
directory's ``metrics/`` (``PROMETHEUS_MULTIPROC_DIR``, set by the supervisor before any
metric exists); whichever worker answers ``/metrics`` reads them all, so the page is the
same from every worker. Counters and histograms are summed (a dead worker's totals stay
counted, as a restarted single process's would not, but a rate over them is right). Each
gauge says how it combines (``multiprocess_mode`` in ``pdproxy.observability.metrics``): in-flight
requests, legs and queue depth are summed over the live processes (``livesum``); instance
counts and health, which every process sees alike, and ejection, which is per worker (1
when any worker ejected the instance), take the live processes' maximum (``livemax``). The
supervisor removes a dead worker's live gauges (``mark_process_dead``).

Two single-process shortcuts do not exist in multiprocess mode, so a worker makes up for them
every ``_SAMPLE`` seconds and before it answers a scrape (``WorkerGauges``): gauges read at
scrape time (``set_function``: in-flight requests, queue depth) are written to the files,
and so are the per-instance leg counts and the shared registry's figures
(``--registry-backend``) as the owner's last snapshot carried them: the owner's own sync
age and pending writes are read at scrape time, so they never reach its files; each
worker's copy does (a snapshot period and a sample old at most), and
``pdproxy_registry_backend_up`` takes the live processes' minimum, the owner's own value
included. Series cannot be removed from the files either, so the exposition drops the
per-instance series (those with a ``url`` label) of instances that are no longer in the
fleet, as a single process removes them.

The same files give ``/status`` and the dashboard the whole proxy's live figures, worker by
worker (``pdproxy.observability.workers_view``): each worker also writes its index there, a
files-only gauge the exposition leaves out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.observability.workers_view import INDEX, ProxyFigures, read_workers

logger = logging.getLogger(__name__)

_SAMPLE = 0.25  # seconds between a worker's writes of its live gauges


class _FleetOnly(Collector):
    """The multiprocess files' families, without series of instances that have left, with
    their own help texts (the files keep none), and every family of ``described`` even when
    no process has a sample of it yet, as a single process exposes them."""

    def __init__(
        self, path: str, present: Callable[[], set[str]], described: CollectorRegistry
    ) -> None:
        self._files = MultiProcessCollector(None, path)  # type: ignore[no-untyped-call]
        self._present = present
        self._described = described
        self._families: dict[str, tuple[str, str]] | None = None  # name -> (help, type)

    def collect(self) -> Iterator[Metric]:
        if self._families is None:
            self._families = {m.name: (m.documentation, m.type) for m in self._described.collect()}
        present = self._present()
        seen = {INDEX}  # files-only: which worker wrote a file, for /status
        for family in self._files.collect():  # type: ignore[no-untyped-call]
            if family.name in seen:
                continue
            seen.add(family.name)
            family.documentation = self._families.get(family.name, (family.documentation,))[0]
            family.samples = [
                s
                for s in family.samples
                if s.labels.get("url") is None or s.labels["url"] in present
            ]
            yield family
        for name, (documentation, kind) in self._families.items():
            if name not in seen:
                yield Metric(name, documentation, kind)


def exposition_registry(
    path: str, registry: EndpointRegistry, described: CollectorRegistry
) -> CollectorRegistry:
    """The registry ``/metrics`` renders in a worker; ``described`` is the worker's own
    metrics registry, for the families' help texts."""
    exposition = CollectorRegistry(auto_describe=False)
    exposition.register(_FleetOnly(path, lambda: {e.url for e in registry.all()}, described))
    return exposition


class WorkerGauges:
    """Writes this worker's scrape-time gauges to its multiprocess files, and reads every
    worker's back (``whole``)."""

    def __init__(
        self,
        metrics: ProxyMetrics,
        registry: EndpointRegistry,
        refresh: Callable[[], None],
        backend: Callable[[], dict[str, Any]],
        *,
        directory: str,
        index: int,
    ) -> None:
        self._metrics = metrics
        self.directory = directory  # the multiprocess files' (PROMETHEUS_MULTIPROC_DIR)
        self._backend = backend  # the shared registry's status, as the owner published it
        self._registry = registry
        self._refresh = refresh  # Membership.refresh_gauges: counts, health, ejection
        self._legs = Gauge(
            "pdproxy_endpoint_in_flight",
            "Legs in flight on an instance.",
            ("role", "url"),
            registry=None,  # the files only; the single-process collector keeps the name
            multiprocess_mode="livesum",
        )
        index_gauge = Gauge(
            INDEX,
            "Which worker wrote these figures.",
            registry=None,  # the files only, left out of the exposition
            multiprocess_mode="livesum",  # one file with the in-flight figures: one read
        )
        index_gauge.set(index)
        self._labels: set[tuple[str, str]] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def whole(self) -> ProxyFigures:
        """Every worker's live figures, this one's as of now, the others' at most a sample
        (``_SAMPLE``) old."""
        self.write()
        return read_workers(self.directory)

    def write(self) -> None:
        self._refresh()
        for gauge in (self._metrics.in_flight, self._metrics.queue_depth):
            gauge.set(_read(gauge))
        self._write_backend()
        seen = set()
        for endpoint in self._registry.all():
            labels = (endpoint.role.value, endpoint.url)
            seen.add(labels)
            self._legs.labels(*labels).set(endpoint.legs.in_flight)
        for labels in self._labels - seen:
            self._legs.labels(*labels).set(0)
            self._legs.remove(*labels)
        self._labels = seen

    def _write_backend(self) -> None:
        status, metrics = self._backend(), self._metrics
        metrics.registry_backend_up.set(1 if status.get("up") else 0)
        metrics.registry_backend_sync_age.set(float(status.get("sync_age_s") or 0.0))
        metrics.registry_backend_pending.set(float(status.get("pending_writes") or 0))

    async def _run(self) -> None:
        while True:
            try:
                self.write()
            except Exception:  # the sampler must outlive any one bad round
                logger.exception("worker: writing the live gauges failed")
            await asyncio.sleep(_SAMPLE)


def _read(gauge: Gauge) -> float:
    """A gauge's value as a scrape would read it (its ``set_function`` if it has one)."""
    samples: Iterable[float] = (s.value for f in gauge.collect() for s in f.samples)
    return next(iter(samples), 0.0)
