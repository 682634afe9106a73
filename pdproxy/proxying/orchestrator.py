"""One request's prefill/decode flow, free of any web framework, with its retries.

pick a pair → the connector fixes the ids → prefill leg → decode leg (``Legs``). A leg that
fails before anything reached the client is retried on another instance of its role
(never the one that just failed), up to ``--max-retries`` per request and within the
fleet-wide retry budget. The connector decides the retry's scope: a decode retry reuses
the prefill's answer only where the KV is certainly still readable by another decode;
otherwise the pair is re-run with a fresh transfer, and the prefill's KV, which no decode
will read, is released (``KVRelease``). Once every instance of a role was tried, the next
pass waits an exponential backoff with jitter. The retry run itself (the limits, the
instances excluded, the backoff) is ``Retries``, shared with the pass-through; this module
keeps what one attempt does. A stream cut after its first bytes may continue on another
decode (``Migrations``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Collection, Sequence
from typing import Any

from pdproxy.config.resilience import RetryConfig
from pdproxy.connectors import KVConnector, Transfer
from pdproxy.errors import UpstreamError
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.observability.request_context import bind_predicted, bind_request_id
from pdproxy.proxying.exchange import ClientRequest, ProxyResponse
from pdproxy.proxying.kv_release import KVRelease
from pdproxy.proxying.leg_runner import DirectLegs, LegRunner
from pdproxy.proxying.legs import Legs, LegSize
from pdproxy.proxying.migration import CountTokens, MigrationRequested, Migrations
from pdproxy.proxying.retries import Retries
from pdproxy.proxying.run import Run, log_decision, replaced
from pdproxy.proxying.steps import RequestStep, StepHooks
from pdproxy.resilience.outlier import OutlierDetector
from pdproxy.resilience.retry import RetryBudget, retry_reason
from pdproxy.scheduling.scheduler import NO_PREFILL, Scheduler
from pdproxy.scheduling.speed import computed_tokens
from pdproxy.types import DecodeOnly, Endpoint, PairDecision, Role, Snapshot
from pdproxy.wire.shaping import client_request_id

__all__ = ["ClientRequest", "Orchestrator", "ProxyResponse"]

logger = logging.getLogger(__name__)


class Orchestrator:
    def __init__(
        self,
        *,
        registry: EndpointRegistry,
        scheduler: Scheduler,
        connector: KVConnector,
        legs: Legs,
        outliers: OutlierDetector,
        release: KVRelease,
        retries: Retries,
        retry: RetryConfig,
        budget: RetryBudget,
        metrics: ProxyMetrics,
        steps: Sequence[RequestStep] = (),
        count_tokens: CountTokens | None = None,
        runner: LegRunner | None = None,
    ) -> None:
        # how the legs run: as the connector says, or nixl-push's own runner (``PushLegs``)
        self._runner = runner or DirectLegs(legs, connector)
        self._registry = registry
        # the optional steps switched on at start-up (``steps``), by hook
        self._steps = StepHooks(steps)
        self._scheduler = scheduler
        self._connector = connector
        self._legs = legs
        self._outliers = outliers
        self._release = release
        self._retries = retries  # over the registry's instances by model (its pool)
        self._metrics = metrics
        self._migrations = Migrations(
            limit=retry.migration_limit,
            budget=budget,
            metrics=metrics,
            serve=self._serve,
            count=count_tokens,
        )

    @property
    def steps(self) -> tuple[RequestStep, ...]:
        """The optional steps switched on at start-up, in their order."""
        return self._steps.steps

    def start(self) -> None:
        self._legs.start()

    async def aclose(self) -> None:
        for close in self._steps.close:
            close()
        await self._runner.aclose()
        await self._legs.aclose()

    async def handle(self, request: ClientRequest) -> ProxyResponse:
        response = await self._serve(request, frozenset())
        if response.stream is not None:
            response.stream = self._migrations.watch(request, response.stream)
        return response

    def push_status(self) -> dict[str, Any] | None:
        """``/status``' push section (None: not ``--kv-connector nixl-push``)."""
        return self._runner.status()

    def migrate_streams(self, url: str) -> int:
        """Cut the streams read from the decode ``url`` now, so that each migrates (if it
        may) instead of finishing there; returns how many were cut."""
        return self._legs.abort_streams(url, MigrationRequested(url))

    async def _serve(self, request: ClientRequest, avoid: frozenset[str]) -> ProxyResponse:
        """``request`` on a pair whose decode is none of ``avoid``, with its retries."""
        retries = self._retries.begin()
        features = self._scheduler.features(request.body, request.session)
        run = Run(features, retries, avoid=avoid)
        if avoid:
            run.tried[Role.DECODE] = set(avoid)
        claimed = self._runner.claim(request)
        try:
            for prepare in self._steps.prepare:
                await prepare(request, run)
            return await self._handle(request, run)
        finally:
            run.unreserve()
            if run.trials:
                self._free_unused_trials(run.trials)
            self._runner.release(claimed)

    def _free_unused_trials(self, trials: list[Endpoint]) -> None:
        """A half-open trial this request took but never sent a leg to (the other leg
        failed first) must not keep the instance out forever."""
        for endpoint in trials:
            if endpoint.legs.in_flight == 0:
                self._outliers.on_abandoned(endpoint)

    async def _handle(self, request: ClientRequest, run: Run) -> ProxyResponse:
        steps = self._steps
        for before_prefill in steps.before_prefill:
            await before_prefill(request, run)
        decision = self._pick(run)
        if isinstance(decision, DecodeOnly):
            return await self._decode_only(request, run, decision)
        if steps.picked:
            computed = self._prefill_size(run, decision).tokens
            for picked in steps.picked:
                picked(request, decision, computed)
        transfer = self._connector.begin(decision, request.request_id)
        log_decision(transfer, "routed")
        answer: dict[str, Any] | None = None
        concurrent = self._concurrent(request, transfer)
        while True:
            decoding = False
            try:
                if concurrent:
                    return await self._both_legs(request, run, transfer)
                if answer is None:
                    answer = await self._prefill_leg(request, run, transfer)
                run.unreserve()
                for before_decode in steps.before_decode:
                    await before_decode(request, run, transfer, answer)
                decoding = True
                for after_prefill in steps.after_prefill:
                    early = after_prefill(request, transfer, answer)
                    if early is not None:
                        return early
                return await self._decode_leg(request, transfer, answer)
            except UpstreamError as error:
                failure = error
            except asyncio.CancelledError:
                # The client left. A decode that had the leg aborts it and vLLM frees P's
                # KV; between the legs nobody would.
                if answer is not None and not decoding:
                    self._release.orphaned(request, transfer, answer, failed=None)
                raise
            if self._prefills_exhausted(run, transfer, failure):
                run.unreserve()
                decision = transfer.decision
                fallback = DecodeOnly(decision.decode, NO_PREFILL, decision.decode_dp_rank)
                return await self._decode_only(request, run, fallback)
            try:
                retried, answer = await self._recover(run, request, transfer, answer, failure)
            except asyncio.CancelledError:
                if answer is not None:  # the client left during a backoff
                    self._release.orphaned(request, transfer, answer, failed=None)
                raise
            if answer is None:  # a fresh transfer (else the decode retried on P's answer)
                concurrent = self._concurrent(request, retried)
            transfer = retried

    async def _both_legs(
        self, request: ClientRequest, run: Run, transfer: Transfer
    ) -> ProxyResponse:
        """A concurrent transfer: both legs at once."""
        size = self._prefill_size(run, transfer.decision)
        for before_decode in self._steps.before_decode:
            await before_decode(request, run, transfer, None)
        return await self._runner.run(request, transfer, size)

    async def _prefill_leg(
        self, request: ClientRequest, run: Run, transfer: Transfer
    ) -> dict[str, Any]:
        """A serial transfer's prefill, its decode reserved (and a connection readied)."""
        run.reserve(transfer.decision.decode)
        self._legs.prepare_decode(request, transfer.decision.decode)
        started = time.perf_counter()
        answer = await self._legs.prefill(
            request, transfer, self._prefill_size(run, transfer.decision)
        )
        self._observe_prefill(transfer.decision, time.perf_counter() - started, answer, run)
        return answer

    async def _decode_leg(
        self, request: ClientRequest, transfer: Transfer, answer: dict[str, Any]
    ) -> ProxyResponse:
        response = await self._runner.decode(request, transfer, answer)
        for answered in self._steps.answered:
            answered(response)
        return response

    def _concurrent(self, request: ClientRequest, transfer: Transfer) -> bool:
        """Whether ``transfer``'s legs go at once (nixl-push decides per request)."""
        return self._runner.concurrent(request, transfer)

    def _observe_prefill(
        self, decision: PairDecision, seconds: float, answer: dict[str, Any], run: Run
    ) -> None:
        """The prefill's speed, per token it computed (its prompt less its hit): a leg
        that hit the cache did less work, not faster work (``scheduling.speed``)."""
        tokens = run.features.tokens
        computed = computed_tokens(tokens, answer, decision.prefill_cached)
        self._scheduler.speeds.observe(decision.prefill, seconds, tokens, computed)

    def _prefill_size(self, run: Run, decision: PairDecision) -> LegSize:
        """How the prefill leg counts while it runs: its weight in typical requests, and
        the prompt tokens it has to compute (less the hit its events predict)."""
        tokens = run.features.tokens
        uncached = max(tokens - (decision.prefill_cached or 0), 0.0)
        return LegSize(self._scheduler.speeds.weight(tokens), uncached)

    def _prefills_exhausted(self, run: Run, transfer: Transfer, failure: UpstreamError) -> bool:
        """Under ``--decode-only-fallback``: a retryable prefill failure with every other
        prefill already tried by this request (or none left) goes to the decode alone."""
        if not self._scheduler.decode_only_fallback or failure.leg != "prefill":
            return False
        if retry_reason(failure) is None:
            return False
        tried = {transfer.decision.prefill.url, *run.tried.get(Role.PREFILL, ())}
        return not self._usable(self._retries.pool(Role.PREFILL, run.features.model), tried)

    async def _decode_only(
        self, request: ClientRequest, run: Run, decision: DecodeOnly
    ) -> ProxyResponse:
        """The request as a plain one on a decode, retried on another decode like a
        decode leg (before the first byte, within the budget)."""
        self._metrics.count_decode_only(decision.reason)
        request_id = client_request_id(request.request_id)
        bind_request_id(request_id)
        decode = decision.decode
        logger.debug("%s: decode only (%s) on %s", request_id, decision.reason, decode.url)
        try:
            return await self._legs.single(request, decode, request_id, decision.decode_dp_rank)
        except UpstreamError as exc:
            error = exc  # retried outside this handler: a later failure is not chained to it

        def attempt(decode: Endpoint, rank: int | None) -> Awaitable[ProxyResponse]:
            return self._legs.single(request, decode, request_id, rank)

        return await self._retries.retry(run, Role.DECODE, decode, error, attempt)

    async def _recover(
        self,
        run: Run,
        request: ClientRequest,
        transfer: Transfer,
        answer: dict[str, Any] | None,
        error: UpstreamError,
    ) -> tuple[Transfer, dict[str, Any] | None]:
        """The transfer (and reusable prefill answer) to try next; re-raises ``error`` when
        it must not or cannot be retried.

        A decode that failed by its own fault may have left P's KV unread; one that
        rejected the leg (a 4xx) has told P itself (vLLM's rejection cleanup).
        """
        role = Role.PREFILL if error.leg == "prefill" else Role.DECODE
        failed = transfer.decision.prefill if role is Role.PREFILL else transfer.decision.decode
        reason = retry_reason(error)
        if reason is None:
            raise error
        try:
            chosen, rank = await self._retries.replacement(run, role, failed, error, reason)
        except UpstreamError:  # no retry left, or no instance to retry on
            self._orphan(request, transfer, answer, failed)
            raise
        decision = replaced(transfer.decision, role, chosen, rank)
        if role is Role.PREFILL and self._outliers.stranded(decision.decode):
            # A push decode stranded by the failed prefill is out of rotation: another.
            decodes = self._usable(self._retries.pool(Role.DECODE, run.features.model), run.avoid)
            decode, decode_rank = self._retries.pick(run, Role.DECODE, decodes)
            decision = replaced(decision, Role.DECODE, decode, decode_rank)
        logger.debug("%s: %s leg failed (%s), retrying", transfer.request_id, error.leg, reason)
        if answer is not None:
            if self._connector.decode_retry_reuses_prefill(transfer, reason):
                retried = dataclasses.replace(transfer, decision=decision)
                log_decision(retried, "decode retried with the same prefill")
                return retried, answer
            self._orphan(request, transfer, answer, failed)
        fresh = self._connector.begin(decision, request.request_id)
        log_decision(fresh, "retried")
        return fresh, None

    def _orphan(
        self,
        request: ClientRequest,
        transfer: Transfer,
        answer: dict[str, Any] | None,
        failed: Endpoint,
    ) -> None:
        if answer is not None:
            self._release.orphaned(request, transfer, answer, failed=failed)

    def _pick(self, run: Run) -> PairDecision | DecodeOnly:
        # The instances serving the request's model (one dict hit): its P and D agree.
        snapshot = self._registry.pools().require(run.features.model)
        view = Snapshot(
            prefill=self._usable(snapshot.prefill, ()),
            decode=self._usable(snapshot.decode, run.avoid),
        )
        for step_view in self._steps.view:  # flow control: the instances with room, if any has
            view = step_view(view)
        decision = self._scheduler.schedule(run.features, view)
        if isinstance(decision, PairDecision):
            self._retries.picked(run, decision.prefill)
            if decision.prefill_cached is not None or decision.decode_cached is not None:
                bind_predicted(decision.prefill_cached, decision.decode_cached)
        self._retries.picked(run, decision.decode)
        return decision

    def _usable(self, pool: tuple[Endpoint, ...], avoid: Collection[str]) -> tuple[Endpoint, ...]:
        return self._outliers.usable(pool, avoid)  # shared with the pass-through endpoints
