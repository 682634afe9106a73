"""The orchestrator's retry loop and its KV-release decisions, with in-memory legs: which
failures are retried, on which instance, with which scope, and when a prefill's KV is
declared orphaned. No sockets."""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client import CollectorRegistry

from engines.sim.kv_events import stored
from pdproxy.build.request_path import by_model
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.resilience import OutlierConfig, RetryConfig
from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.connectors import load_connector
from pdproxy.errors import (
    NoEndpointAvailable,
    UpstreamConnectError,
    UpstreamServerError,
    UpstreamStatusError,
)
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.proxying.exchange import ClientRequest, ProxyResponse
from pdproxy.proxying.legs import LegSize
from pdproxy.proxying.orchestrator import Orchestrator
from pdproxy.proxying.retries import Retries
from pdproxy.resilience.outlier import OutlierDetector
from pdproxy.resilience.retry import RetryBudget
from pdproxy.scheduling.kv_events import decode_batch
from pdproxy.scheduling.kv_keys import instance_name
from pdproxy.scheduling.scheduler import Scheduler
from pdproxy.types import ApiKind, Endpoint, EngineAddress, Role, Source

REQUEST = ClientRequest(ApiKind.COMPLETIONS, {"model": "m", "prompt": "p"}, None, None)
ANSWER = {"kv_transfer_params": {"remote_block_ids": [[1]], "remote_engine_id": "e"}}


class FakeLegs:
    """Scripted legs: ``decode_script`` lists, per decode attempt, an error to raise or
    None to answer; every call is recorded as (leg, url)."""

    def __init__(self, decode_script=(), prefill_script=(), decode_hangs=False):
        self.calls: list[tuple[str, str]] = []
        self.sizes: list[tuple[float, int | None]] = []  # each prefill's tokens and prediction
        self._decode = list(decode_script)
        self._prefill = list(prefill_script)
        self._hang = decode_hangs

    def prepare_decode(self, request, decode):
        pass  # the real legs open a connection to the decode while the prefill runs

    async def prefill(self, request, transfer, size=None):
        size = size or LegSize()
        self.calls.append(("prefill", transfer.decision.prefill.url))
        self.sizes.append((size.tokens, transfer.decision.prefill_cached))
        error = self._prefill.pop(0) if self._prefill else None
        if error is not None:
            raise error
        return dict(ANSWER)

    async def decode(self, request, transfer, answer):
        self.calls.append(("decode", transfer.decision.decode.url))
        if self._hang:
            await asyncio.Event().wait()
        error = self._decode.pop(0) if self._decode else None
        if error is not None:
            raise error
        return ProxyResponse(200, "application/json", transfer.request_id, body=b"{}")


class FakeRelease:
    def __init__(self):
        self.orphans: list[str | None] = []

    def orphaned(self, request, transfer, answer, *, failed):
        self.orphans.append(failed.url if failed else None)


def _orchestrator(legs, *, connector="nixl", decodes=2, retry=None, scheduling=None, steps=()):
    registry = EndpointRegistry(lambda: 0.0)
    for i in range(2):
        registry.add(_endpoint(Role.PREFILL, f"http://p{i}:1"))
    for i in range(decodes):
        registry.add(_endpoint(Role.DECODE, f"http://d{i}:1"))
    addr = (EngineAddress(url="http://a:1"),)
    config = ProxyConfig(prefill=addr, decode=addr, kv_connector=connector)
    release = FakeRelease()
    retry = retry or RetryConfig(initial_backoff=0.001, max_backoff=0.001)
    scheduler = Scheduler(
        scheduling or SchedulingConfig(prefill_policy="round-robin", decode_policy="round-robin"),
        clock=lambda: 0.0,
        rng=random.Random(1),
        max_age=3.0,
    )
    outliers = OutlierDetector(OutlierConfig(), lambda: 0.0)
    budget = RetryBudget(ratio=1, window=10, min_per_sec=100, clock=lambda: 0.0)
    metrics = ProxyMetrics(CollectorRegistry())
    retries = Retries(
        scheduler=scheduler,
        outliers=outliers,
        pool=by_model(registry),
        retry=retry,
        budget=budget,
        metrics=metrics,
        rng=random.Random(1),
    )
    orchestrator = Orchestrator(
        registry=registry,
        scheduler=scheduler,
        connector=load_connector(config),
        legs=legs,
        outliers=outliers,
        release=release,
        retries=retries,
        retry=retry,
        budget=budget,
        metrics=metrics,
        steps=steps,
    )
    return orchestrator, release


def _endpoint(role, url):
    return Endpoint.new(role=role, address=EngineAddress(url=url), source=Source.STATIC)


def _connect():
    return UpstreamConnectError("refused", leg="decode")


def _5xx():
    return UpstreamStatusError(leg="decode", status=503, body=b"{}", content_type="x")


async def test_decode_never_reached_is_retried_on_the_other_with_the_same_prefill():
    legs = FakeLegs(decode_script=[_connect()])
    orchestrator, release = _orchestrator(legs)
    assert (await orchestrator.handle(REQUEST)).status == 200
    assert legs.calls == [
        ("prefill", "http://p0:1"),
        ("decode", "http://d0:1"),
        ("decode", "http://d1:1"),
    ]
    assert release.orphans == []


async def test_decode_5xx_reruns_the_pair_and_releases_the_first_prefill():
    legs = FakeLegs(decode_script=[_5xx()])
    orchestrator, release = _orchestrator(legs)
    assert (await orchestrator.handle(REQUEST)).status == 200
    assert [leg for leg, _ in legs.calls] == ["prefill", "decode", "prefill", "decode"]
    assert legs.calls[3] == ("decode", "http://d1:1")
    assert release.orphans == ["http://d0:1"]


async def test_decode_4xx_is_not_retried_and_its_decode_released_the_kv_itself():
    rejected = UpstreamStatusError(leg="decode", status=400, body=b"{}", content_type="x")
    orchestrator, release = _orchestrator(FakeLegs(decode_script=[rejected]))
    with pytest.raises(UpstreamStatusError):
        await orchestrator.handle(REQUEST)
    assert release.orphans == []


async def test_exhausted_retries_raise_the_last_error_and_release():
    legs = FakeLegs(decode_script=[_5xx(), _5xx(), _5xx()])
    orchestrator, release = _orchestrator(legs)
    with pytest.raises(UpstreamStatusError):
        await orchestrator.handle(REQUEST)
    decodes = [url for leg, url in legs.calls if leg == "decode"]
    assert len(decodes) == 3 and decodes[0] != decodes[1]  # never the one that just failed
    assert decodes[1] != decodes[2]
    assert len(release.orphans) == 3


async def test_prefill_failure_is_retried_on_the_other_prefill():
    legs = FakeLegs(prefill_script=[UpstreamServerError(leg="prefill", status=500)])
    orchestrator, _ = _orchestrator(legs)
    assert (await orchestrator.handle(REQUEST)).status == 200
    assert legs.calls[:2] == [("prefill", "http://p0:1"), ("prefill", "http://p1:1")]


async def test_a_prefill_leg_counts_its_prompt_less_its_predicted_hit_and_a_retry_all_of_it():
    """``LegCounts.queued_tokens`` gets the prompt's uncached tokens; the prediction was for
    the first prefill only, so its replacement counts (and is checked against) none."""
    ids = list(range(500, 628))  # 8 blocks of 16: 7 may hit
    legs = FakeLegs(prefill_script=[None, UpstreamServerError(leg="prefill", status=500)])
    kv_events = SchedulingConfig(prefill_policy="kv-events", decode_policy="round-robin")
    orchestrator, _ = _orchestrator(legs, scheduling=kv_events)
    kv = orchestrator._scheduler.kv_index
    for i in range(2):
        kv.follow(instance_name(f"http://p{i}:1", 0))
    event = stored(list(range(8)), None, ids, 16, "map")
    kv.apply(instance_name("http://p0:1", 0), decode_batch([0.0, [event], 0])[0])
    request = ClientRequest(ApiKind.COMPLETIONS, {"model": "m", "prompt": ids}, None, None)
    assert (await orchestrator.handle(request)).status == 200
    assert legs.sizes == [(128.0 - 112, 112)]
    assert (await orchestrator.handle(request)).status == 200  # p0 fails, p1 retries
    assert legs.calls[2:4] == [("prefill", "http://p0:1"), ("prefill", "http://p1:1")]
    assert legs.sizes[1:] == [(16.0, 112), (128.0, None)]


async def test_single_decode_is_retried_after_a_backoff():
    legs = FakeLegs(decode_script=[_connect()])
    orchestrator, _ = _orchestrator(legs, decodes=1)
    assert (await orchestrator.handle(REQUEST)).status == 200
    assert [url for leg, url in legs.calls if leg == "decode"] == ["http://d0:1"] * 2


async def test_max_retries_zero_never_retries():
    orchestrator, release = _orchestrator(
        FakeLegs(decode_script=[_5xx()]), retry=RetryConfig(max_retries=0)
    )
    with pytest.raises(UpstreamStatusError):
        await orchestrator.handle(REQUEST)
    assert release.orphans == ["http://d0:1"]


async def test_client_leaving_during_the_decode_leaves_the_release_to_the_decode():
    orchestrator, release = _orchestrator(FakeLegs(decode_hangs=True))
    task = asyncio.create_task(orchestrator.handle(REQUEST))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert release.orphans == []  # vLLM frees P's KV when the decode leg is aborted


async def test_client_leaving_between_the_legs_releases():
    legs = FakeLegs(decode_script=[_connect(), _connect()])
    slow = RetryConfig(initial_backoff=5, max_backoff=5)
    orchestrator, release = _orchestrator(legs, retry=slow)
    task = asyncio.create_task(orchestrator.handle(REQUEST))
    await asyncio.sleep(0.05)  # both decodes refused: now in the backoff, between the legs
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert release.orphans == [None]


async def test_no_instance_at_all_is_a_503():
    orchestrator, _ = _orchestrator(FakeLegs(), decodes=0)
    with pytest.raises(NoEndpointAvailable):
        await orchestrator.handle(REQUEST)


@pytest.mark.parametrize("connector", ["p2p-nccl", "moriio"])
async def test_id_connectors_get_a_fresh_request_id_for_a_rerun(connector):
    seen = []

    class Recording(FakeLegs):
        async def decode(self, request, transfer, answer):
            seen.append(transfer.request_id)
            return await super().decode(request, transfer, answer)

    orchestrator, _ = _orchestrator(Recording(decode_script=[_5xx()]), connector=connector)
    await orchestrator.handle(REQUEST)
    assert len(seen) == 2 and seen[0] != seen[1]


async def test_a_trial_whose_leg_never_ran_is_freed():
    """Regression: a half-open decode picked by a request whose prefill then failed for
    good stayed 'trial in flight' forever, out of rotation."""
    rejected = UpstreamStatusError(leg="prefill", status=400, body=b"{}", content_type="x")
    orchestrator, _ = _orchestrator(FakeLegs(prefill_script=[rejected]))
    decode = orchestrator._registry.get("http://d0:1")
    decode.health.ejected_until = 0.0  # ejection over: half-open, the next pick is its trial
    with pytest.raises(UpstreamStatusError):
        await orchestrator.handle(REQUEST)
    assert orchestrator._outliers.available(decode)
