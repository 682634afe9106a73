"""The whole proxy's figures under ``--workers`` from each worker's own samples
(``pdproxy.observability.workers_view``): a worker is named by the index it writes, the
owner (no index) is no worker, and the sums are over every worker; the dashboard reads the
files only while watched. The files themselves are read in
``tests/integration/test_workers.py``."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.metrics_core import Metric

from pdproxy.api.dashboard import WATCHED, Dashboard
from pdproxy.observability.workers_view import (
    INDEX,
    ProxyFigures,
    WorkerFigures,
    worker_figures,
)

D = "http://10.0.0.2:8200"
P = "http://10.0.0.1:8100"


def _families(index: int | None, in_flight: float, queued: float, legs: dict[str, float]):
    gauge = Metric("pdproxy_requests_in_flight", "", "gauge")
    gauge.add_sample("pdproxy_requests_in_flight", {"pid": "7"}, in_flight)
    queue = Metric("pdproxy_queue_depth", "", "gauge")
    queue.add_sample("pdproxy_queue_depth", {"pid": "7"}, queued)
    per_url = Metric("pdproxy_endpoint_in_flight", "", "gauge")
    for url, n in legs.items():
        per_url.add_sample("pdproxy_endpoint_in_flight", {"role": "decode", "url": url}, n)
    families = [gauge, queue, per_url]
    if index is not None:
        marker = Metric(INDEX, "", "gauge")
        marker.add_sample(INDEX, {"pid": "7"}, index)
        families.append(marker)
    return families


def test_a_worker_is_named_by_the_index_it_wrote():
    figures = worker_figures(7, _families(1, 3.0, 2.0, {D: 3.0, P: 0.0}))
    assert figures == WorkerFigures(1, 7, in_flight=3, queue_depth=2, legs={D: 3, P: 0})
    assert figures.as_dict() == {
        "index": 1,
        "pid": 7,
        "in_flight": 3,
        "queue_depth": 2,
        "legs": {P: 0, D: 3},
    }


def test_the_owner_writes_no_index_and_is_no_worker():
    assert worker_figures(1, _families(None, 0.0, 0.0, {})) is None


def test_the_whole_proxy_sums_every_worker():
    whole = ProxyFigures(
        (
            WorkerFigures(0, 10, in_flight=4, queue_depth=1, legs={D: 4}),
            WorkerFigures(1, 11, in_flight=2, queue_depth=0, legs={D: 1, P: 1}),
        )
    )
    assert (whole.in_flight, whole.queue_depth) == (6, 1)
    assert (whole.legs(D), whole.legs(P), whole.legs("http://gone:1")) == (5, 1, 0)
    assert ProxyFigures(()).in_flight == 0


def test_the_dashboard_reads_every_workers_files_only_while_watched():
    """Under --workers the 1 s sampler reads every process's files (milliseconds of the
    loop) only for ``WATCHED`` seconds after the page asked; a single process always samples
    its own metric objects."""
    now = [100.0]
    workers = Dashboard(SimpleNamespace(worker_gauges=object()), lambda: now[0])
    assert not workers.due()  # nobody has asked yet
    workers.watched(now[0])
    now[0] += WATCHED
    assert workers.due()
    now[0] += 0.5
    assert not workers.due()
    single = Dashboard(SimpleNamespace(worker_gauges=None), lambda: now[0])
    assert single.due()
