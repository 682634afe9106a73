"""The request path of one pdproxy: the scheduler, the orchestrator, the pass-through and
``--render-once``, built once on the shared objects (``pdproxy.build.core``)."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Collection
from dataclasses import dataclass

from pdproxy.build.core import Core, bearer
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.resilience import RetryConfig
from pdproxy.connectors.nixl_push import NixlPushConnector
from pdproxy.errors import ConfigError
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.membership.kv_fleet import KVEventFleet
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.proxying.admission import Admission
from pdproxy.proxying.deadlines import TtftPredictor
from pdproxy.proxying.first_token import FirstTokenPath
from pdproxy.proxying.kv_release import KVRelease
from pdproxy.proxying.leg_bracket import LegBracket
from pdproxy.proxying.leg_room import LegRoom
from pdproxy.proxying.leg_runner import DirectLegs, LegRunner
from pdproxy.proxying.legs import Legs
from pdproxy.proxying.lora_demand import LoraOnDemand
from pdproxy.proxying.orchestrator import Orchestrator
from pdproxy.proxying.passthrough import Passthrough
from pdproxy.proxying.prompt_tokens import PromptTokens
from pdproxy.proxying.push import PushLegs
from pdproxy.proxying.render_once import RenderOnce
from pdproxy.proxying.retries import Retries
from pdproxy.proxying.steps import (
    DeadlineStep,
    FirstTokenStep,
    LegRoomStep,
    LoraStep,
    PromptTokensStep,
    RequestStep,
)
from pdproxy.proxying.token_count import TokenCounter
from pdproxy.proxying.verdicts import Verdicts
from pdproxy.resilience.retry import RetryBudget
from pdproxy.scheduling.scheduler import Scheduler
from pdproxy.types import Endpoint, Role, Source
from pdproxy.wire.local_tokenizer import LocalTokenizer

logger = logging.getLogger(__name__)

# the instances of a role (serving a model) a request path picks and retries among
Pool = Callable[[Role, str | None], tuple[Endpoint, ...]]


@dataclass(frozen=True, slots=True)
class RequestPath:
    orchestrator: Orchestrator
    passthrough: Passthrough  # the endpoints served by one decode (pdproxy.wire.routes)
    render_once: RenderOnce | None  # --render-once
    kv_events: KVEventFleet | None  # --kv-events-endpoint, or a policy that reads KV events


def build_request_path(
    config: ProxyConfig,
    core: Core,
    release: KVRelease,
    clock: Callable[[], float],
    rng: random.Random,
) -> RequestPath:
    scheduler = _scheduler(config, core, clock, rng)
    budget = _retry_budget(config.retry, clock)  # fleet-wide: generation and pass-through
    passthrough = _passthrough(config, core, scheduler, budget, rng)
    count = TokenCounter(passthrough)  # a migrated text stream's tokens, by its engines
    orchestrator = _orchestrator(config, core, release, scheduler, budget, rng, clock, count)
    render_once = None
    if config.render_once:
        render_once = _render_once(config, core, orchestrator, scheduler, budget, rng, clock)
    kv_events = None
    if config.scheduling.kv_events_endpoint is not None or scheduler.kv_events:
        kv_events = KVEventFleet(config.scheduling, core.registry, scheduler.kv_index)
    return RequestPath(orchestrator, passthrough, render_once, kv_events)


def _orchestrator(
    config: ProxyConfig,
    core: Core,
    release: KVRelease,
    scheduler: Scheduler,
    budget: RetryBudget,
    rng: random.Random,
    clock: Callable[[], float],
    count_tokens: TokenCounter,
) -> Orchestrator:
    room = _leg_room(config, core.admission, clock)
    legs = Legs(
        connector=core.connector,
        client=core.client,
        timeouts=config.timeouts,
        bracket=LegBracket(core.verdicts, core.metrics, room),
        metrics=core.metrics,
        kv_check=scheduler.verify_prefill if scheduler.kv_events else None,
    )
    runner: LegRunner = DirectLegs(legs, core.connector)
    if isinstance(core.connector, NixlPushConnector):
        runner = PushLegs(
            connector=core.connector,
            legs=legs,
            outliers=core.outliers,
            metrics=core.metrics.push,
            timeouts=config.timeouts,
        )
    retries = _retries(config, core, scheduler, budget, rng, by_model(core.registry))
    return Orchestrator(
        registry=core.registry,
        scheduler=scheduler,
        connector=core.connector,
        legs=legs,
        outliers=core.outliers,
        release=release,
        retries=retries,
        retry=config.retry,
        budget=budget,
        metrics=core.metrics,
        steps=_steps(config, core, scheduler, legs, release, retries, room, clock),
        count_tokens=count_tokens,
        runner=runner,
    )


def _steps(
    config: ProxyConfig,
    core: Core,
    scheduler: Scheduler,
    legs: Legs,
    release: KVRelease,
    retries: Retries,
    room: LegRoom | None,
    clock: Callable[[], float],
) -> tuple[RequestStep, ...]:
    """The orchestrator's optional steps, each only when its feature is on, in the order
    their hooks run (``pdproxy.proxying.steps``): a feature that adds work to a request
    adds its step here."""
    steps: list[RequestStep] = []
    tokens = _prompt_tokens(config, scheduler, core.metrics)  # --tokenizer
    if tokens is not None:
        steps.append(PromptTokensStep(tokens))
    lora = _lora_on_demand(config, core, scheduler, clock)  # --lora-load-on-demand
    if lora is not None:
        steps.append(LoraStep(lora))
    if room is not None:  # --tenants, --prefill-capacity, --decode-capacity

        def usable(role: Role, model: str | None, avoid: Collection[str]) -> tuple[Endpoint, ...]:
            return core.outliers.usable(retries.pool(role, model), avoid)

        steps.append(LegRoomStep(room, usable, release))
    if config.tenants.enabled and core.admission is not None:  # x-slo-ttft-ms
        steps.append(DeadlineStep(TtftPredictor(scheduler.speeds, core.admission.book, clock)))
    if config.first_token_from_prefill:
        steps.append(FirstTokenStep(FirstTokenPath(legs=legs, release=release)))
    return tuple(steps)


def _leg_room(
    config: ProxyConfig, admission: Admission | None, clock: Callable[[], float]
) -> LegRoom | None:
    """Flow control's leg waits: under ``--tenants`` (capacities learned unless given),
    or wherever ``--prefill-capacity`` / ``--decode-capacity`` is given."""
    limits = config.admission
    capacity = {Role.PREFILL: limits.prefill_capacity, Role.DECODE: limits.decode_capacity}
    if admission is None or not (config.tenants.enabled or any(capacity.values())):
        return None
    return LegRoom(
        capacity=capacity, book=admission.book, max_wait=limits.queue_timeout, clock=clock
    )


def _prompt_tokens(
    config: ProxyConfig, scheduler: Scheduler, metrics: ProxyMetrics
) -> PromptTokens | None:
    """--tokenizer: loaded only when a kv-events policy reads token ids; raises
    ``ConfigError`` for files it cannot load."""
    specs = config.scheduling.tokenizers
    if not specs:
        return None
    if not scheduler.kv_events:
        logger.warning("--tokenizer is ignored: only the kv-events policy reads token ids")
        return None
    tokenizers = {model: LocalTokenizer.load(path) for model, path in specs}
    counter = metrics.prompt_tokens
    return PromptTokens(
        tokenizers, scheduler.wants_token_ids, count=lambda outcome: counter.labels(outcome).inc()
    )


def _lora_on_demand(
    config: ProxyConfig, core: Core, scheduler: Scheduler, clock: Callable[[], float]
) -> LoraOnDemand | None:
    if not config.lora.load_on_demand:
        return None
    headers = {"content-type": "application/json"}
    authorization = bearer(config.engine_api_key)
    if authorization is not None:
        headers["authorization"] = authorization
    return LoraOnDemand(
        config.lora,
        registry=core.registry,
        lora=core.lora,
        scheduler=scheduler,
        outliers=core.outliers,
        headers=headers,
        clock=clock,
        spread_at=(
            config.scheduling.balance_abs_threshold,
            config.scheduling.balance_rel_threshold,
        ),
    )


def _passthrough(
    config: ProxyConfig,
    core: Core,
    scheduler: Scheduler,
    budget: RetryBudget,
    rng: random.Random,
) -> Passthrough:
    return Passthrough(
        registry=core.registry,
        client=core.client,
        timeouts=config.timeouts,
        bracket=LegBracket(core.verdicts, core.metrics),
        outliers=core.outliers,
        retries=_retries(config, core, scheduler, budget, rng, _decodes(core.registry)),
        metrics=core.metrics,
    )


def _retries(
    config: ProxyConfig,
    core: Core,
    scheduler: Scheduler,
    budget: RetryBudget,
    rng: random.Random,
    pool: Pool,
) -> Retries:
    """One request path's picks and retries among ``pool``, under the fleet-wide budget."""
    return Retries(
        scheduler=scheduler,
        outliers=core.outliers,
        pool=pool,
        retry=config.retry,
        budget=budget,
        metrics=core.metrics,
        rng=rng,
    )


def by_model(registry: EndpointRegistry) -> Pool:
    """The instances of a role serving a model (the generation endpoints' pool)."""

    def pool(role: Role, model: str | None) -> tuple[Endpoint, ...]:
        snapshot = registry.pools().lookup(model)
        return snapshot.prefill if role is Role.PREFILL else snapshot.decode

    return pool


def _decodes(registry: EndpointRegistry) -> Pool:
    """Every decode, whatever the role and model asked (the pass-through's pool)."""
    return lambda _role, _model: registry.snapshot().decode


def _only(servers: tuple[Endpoint, ...]) -> Pool:
    """These instances alone (the --render servers)."""
    return lambda _role, _model: servers


def _render_once(
    config: ProxyConfig,
    core: Core,
    orchestrator: Orchestrator,
    scheduler: Scheduler,
    budget: RetryBudget,
    rng: random.Random,
    clock: Callable[[], float],
) -> RenderOnce:
    """--render-once: renders on the --render servers (picked, retried and ejected like
    decodes, among themselves), else on the decodes."""
    if not core.connector.serves_decode_alone:
        raise ConfigError(
            f"--render-once needs decodes that answer alone; {config.kv_connector}'s wait for KV"
        )
    servers = tuple(
        Endpoint.new(role=Role.DECODE, address=a, source=Source.STATIC) for a in config.render
    )
    pool = _only(servers) if servers else _decodes(core.registry)
    peers = (lambda _: servers) if servers else None
    render = Passthrough(
        registry=core.registry,
        client=core.client,
        timeouts=config.timeouts,
        # the --render servers are one another's peers, not the decodes'
        bracket=LegBracket(
            Verdicts(core.outliers, core.registry, core.metrics, peers), core.metrics
        ),
        outliers=core.outliers,
        retries=_retries(config, core, scheduler, budget, rng, pool),
        metrics=core.metrics,
    )
    return RenderOnce(
        orchestrator=orchestrator,
        render=render,
        registry=core.registry,
        client=core.client,
        metrics=core.metrics,
        clock=clock,
    )


def _scheduler(
    config: ProxyConfig, core: Core, clock: Callable[[], float], rng: random.Random
) -> Scheduler:
    # An engine's load figures count for three scrape intervals, then they are ignored.
    max_age = 3 * config.health.engine_metrics_interval
    decode_only = config.scheduling.pd_threshold_tokens or config.scheduling.decode_only_fallback
    if decode_only and not core.connector.serves_decode_alone:
        raise ConfigError(
            f"--pd-threshold-tokens and --decode-only-fallback need decodes that can serve a"
            f" request alone, which {config.kv_connector}'s cannot (they wait for their"
            " prefill's KV)"
        )
    scheduler = Scheduler(
        config.scheduling,
        clock=clock,
        rng=rng,
        max_age=max_age,
        decode_alone=core.connector.serves_decode_alone,
    )
    core.registry.on_removal(scheduler.forget)
    return scheduler


def _retry_budget(config: RetryConfig, clock: Callable[[], float]) -> RetryBudget:
    return RetryBudget(
        ratio=config.budget_ratio,
        window=config.budget_window,
        min_per_sec=config.budget_min_per_sec,
        clock=clock,
    )
