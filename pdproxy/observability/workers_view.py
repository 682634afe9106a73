"""The whole proxy under ``--workers``: every worker's live figures, read from the files
``/metrics`` already reads.

The source of truth is prometheus_client's multiprocess files (``pdproxy.observability.
multiproc``): every worker writes its in-flight requests, admission queue and legs per
instance to its own ``gauge_livesum_<pid>.db`` every 0.25 s (``WorkerGauges``), and the
answering worker writes its own just before it reads. So ``/status`` and the dashboard sum
the same figures ``/metrics`` sums, each worker's at most 0.25 s old, and name each worker by
its index (a files-only gauge, ``INDEX``, that the exposition leaves out) and pid. The owner
serves no request and writes no index, so it is not a worker here; a dead worker's files are
removed by the supervisor before it is replaced (``mark_process_dead``).

The request and first-byte totals the dashboard's windows are computed from are read from the
same files (every process's counters and histograms, dead workers' included, as ``/metrics``
sums them).
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

INDEX = "pdproxy_worker_index"  # files-only: which worker wrote a file (its index)
_IN_FLIGHT = "pdproxy_requests_in_flight"
_QUEUE = "pdproxy_queue_depth"
_LEGS = "pdproxy_endpoint_in_flight"
_LIVE = "gauge_livesum_"  # + "<pid>.db": one per process, the gauges summed over the live ones


@dataclass(frozen=True, slots=True)
class WorkerFigures:
    """One worker's live figures as its last write left them."""

    index: int
    pid: int
    in_flight: int = 0  # client requests being served
    queue_depth: int = 0  # requests waiting for an admission slot
    legs: Mapping[str, int] = field(default_factory=dict)  # instance URL -> legs in flight

    def as_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "pid": self.pid,
            "in_flight": self.in_flight,
            "queue_depth": self.queue_depth,
            "legs": dict(sorted(self.legs.items())),
        }


@dataclass(frozen=True, slots=True)
class ProxyFigures:
    """Every worker's figures, by index, and their sums: the whole proxy."""

    workers: tuple[WorkerFigures, ...]

    @property
    def in_flight(self) -> int:
        return sum(w.in_flight for w in self.workers)

    @property
    def queue_depth(self) -> int:
        return sum(w.queue_depth for w in self.workers)

    def legs(self, url: str) -> int:
        """Legs in flight on the instance, over every worker."""
        return sum(w.legs.get(url, 0) for w in self.workers)


def read_workers(directory: str) -> ProxyFigures:
    """Each worker's figures from its live-gauge file in ``directory`` (the run directory's
    ``metrics/``), sorted by index; a file without an index (the owner's) is skipped."""
    workers = []
    for path in glob.glob(os.path.join(directory, _LIVE + "*.db")):
        pid = int(os.path.basename(path)[len(_LIVE) : -len(".db")])
        # One file, so nothing is summed: each sample is this process's own.
        families = MultiProcessCollector.merge([path], accumulate=False)  # type: ignore[no-untyped-call]
        worker = worker_figures(pid, families)
        if worker is not None:
            workers.append(worker)
    return ProxyFigures(tuple(sorted(workers, key=lambda w: (w.index, w.pid))))


def worker_figures(pid: int, families: Iterable[Metric]) -> WorkerFigures | None:
    """The figures of the process ``pid`` from its own samples; None without an index."""
    index: int | None = None
    in_flight = queue = 0
    legs: dict[str, int] = {}
    for sample in _samples(families):
        if sample.name == INDEX:
            index = int(sample.value)
        elif sample.name == _IN_FLIGHT:
            in_flight = int(sample.value)
        elif sample.name == _QUEUE:
            queue = int(sample.value)
        elif sample.name == _LEGS and "url" in sample.labels:
            legs[sample.labels["url"]] = int(sample.value)
    if index is None:
        return None
    return WorkerFigures(index, pid, in_flight, queue, legs)


def read_totals_samples(directory: str, names: Iterable[str]) -> dict[str, list[Any]]:
    """The samples of the counter and histogram families ``names``, summed over every
    process's files in ``directory`` as ``/metrics`` sums them (cumulative buckets)."""
    files = glob.glob(os.path.join(directory, "counter_*.db"))
    files += glob.glob(os.path.join(directory, "histogram_*.db"))
    wanted = set(names)
    merged = MultiProcessCollector.merge(files, accumulate=True)  # type: ignore[no-untyped-call]
    found: dict[str, list[Any]] = {name: [] for name in wanted}
    for family in merged:
        if family.name in wanted:
            found[family.name].extend(family.samples)
    return found


def _samples(families: Iterable[Metric]) -> Iterator[Any]:
    for family in families:
        yield from family.samples
