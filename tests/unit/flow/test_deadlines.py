"""The time to first token predicted once the pair is chosen (pdproxy.proxying.deadlines)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from pdproxy.config.tenants import TenantsConfig, TenantSpec
from pdproxy.errors import Overloaded
from pdproxy.flow.ticket import Ticket
from pdproxy.observability.flow_book import FlowBook
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.observability.request_context import RequestTrace, bind, unbind
from pdproxy.proxying.deadlines import TtftPredictor
from pdproxy.scheduling.speed import SpeedTracker
from pdproxy.types import Endpoint, EngineAddress, PairDecision, Role, Source


class _Clock:
    now = 50.0

    def __call__(self) -> float:
        return self.now


def _endpoint(port: int, role: Role) -> Endpoint:
    return Endpoint.new(
        role=role, address=EngineAddress(url=f"http://127.0.0.1:{port}"), source=Source.STATIC
    )


def _setup():
    clock = _Clock()
    speeds = SpeedTracker()
    book = FlowBook(ProxyMetrics(CollectorRegistry()), TenantsConfig())
    predictor = TtftPredictor(speeds, book, clock)
    pair = PairDecision(_endpoint(1, Role.PREFILL), _endpoint(2, Role.DECODE))
    return clock, speeds, book, predictor, pair


def _ticket(clock: _Clock, ms: float | None) -> Ticket:
    deadline = None if ms is None else clock.now + ms / 1000
    return Ticket("t", TenantSpec(), 0, 10.0, 10.0, deadline, ms)


@pytest.fixture(autouse=True)
def _trace():
    token = bind(RequestTrace("/v1/completions"))
    yield
    unbind(token)


def test_nothing_is_refused_before_the_prefills_speed_is_measured():
    clock, _, book, predictor, pair = _setup()
    predictor.check(_ticket(clock, 1.0), pair, 10_000, streamed=True)  # 1 ms: no figures
    assert book.status()["tenants"].get("t") is None


def test_a_prefill_whose_queue_passes_the_deadline_is_refused_before_anything_is_sent():
    clock, speeds, book, predictor, pair = _setup()
    p = pair.prefill
    for tokens, seconds in ((100, 0.11), (1000, 1.01), (500, 0.51)):  # 1 ms a token + 10 ms
        speeds.observe(p, seconds, tokens, tokens)
    predictor.check(_ticket(clock, 400), pair, 200, streamed=True)  # ~0.21 s: in time
    p.legs.queued_tokens = 1000.0  # what its legs in flight still compute: ~1.2 s now
    with pytest.raises(Overloaded) as refused:
        predictor.check(_ticket(clock, 400), pair, 200, streamed=True)
    assert refused.value.code == "deadline_exceeded"
    assert "x-slo-ttft-ms: 400" in str(refused.value)
    assert book.status()["tenants"]["t"]["refused"] == {"deadline": 1}
    predictor.check(_ticket(clock, None), pair, 200, streamed=True)  # no deadline: no look


def test_the_prediction_is_kept_and_its_error_reported_when_the_first_byte_goes_out():
    clock, speeds, book, predictor, pair = _setup()
    speeds.observe(pair.prefill, 0.1, 100, 100)
    ticket = _ticket(clock, 1000)
    predictor.check(ticket, pair, 100, streamed=True)
    from pdproxy.observability.request_context import current

    predicted = current().predicted_ttft
    assert predicted is not None and 0.09 < predicted < 0.2
    book.answered(ticket, predicted + 0.05, predicted)
    assert book.status()["prediction"] == {"samples": 1, "median_error_ms": 50.0}
    assert book.status()["tenants"]["t"]["slo_met"] == 1


def test_one_size_seen_bounds_the_prediction_from_below_never_above():
    _, speeds, _, _, pair = _setup()
    speeds.observe(pair.prefill, 1.0, 1000, 1000)  # one size: 1 s for 1,000 tokens
    # 4,000 tokens: a linear cost through (1000, 1 s) with any fixed part takes >= 1 s
    assert speeds.prefill_seconds(pair.prefill, 4000) == pytest.approx(1.0)
    # 100 tokens: at most 0.1 s if it were all per-token
    assert speeds.prefill_seconds(pair.prefill, 100) == pytest.approx(0.1)
