"""Every stateful object of one pdproxy, built once from its config and handed to whoever uses it,
gathered into one ``AppState``."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from pdproxy.api.auth import ClientKeys
from pdproxy.api.state import AppState
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.resilience import RetryConfig
from pdproxy.connectors import KVConnector, load_connector
from pdproxy.errors import ConfigError
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.membership.health import HealthChecker
from pdproxy.membership.kv_fleet import KVEventFleet
from pdproxy.membership.load_scraper import LoadScraper
from pdproxy.membership.membership import Membership
from pdproxy.membership.models import ModelReader
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.proxying.admission import Admission
from pdproxy.proxying.deadlines import TtftPredictor
from pdproxy.proxying.kv_release import KVRelease
from pdproxy.proxying.leg_room import LegRoom
from pdproxy.proxying.legs import Legs
from pdproxy.proxying.lifecycle import Lifecycle
from pdproxy.proxying.lora import LoraClient
from pdproxy.proxying.lora_demand import LoraOnDemand
from pdproxy.proxying.orchestrator import Orchestrator
from pdproxy.proxying.passthrough import Passthrough
from pdproxy.proxying.prompt_tokens import PromptTokens
from pdproxy.proxying.render_once import RenderOnce
from pdproxy.proxying.verdicts import Verdicts
from pdproxy.resilience.outlier import OutlierDetector
from pdproxy.resilience.retry import RetryBudget
from pdproxy.scheduling.scheduler import Scheduler
from pdproxy.types import Endpoint, Role, Source
from pdproxy.upstream.engine_client import EngineClient
from pdproxy.wire.local_tokenizer import LocalTokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Core:
    """What every part of the state shares."""

    registry: EndpointRegistry
    client: EngineClient
    metrics: ProxyMetrics
    connector: KVConnector
    outliers: OutlierDetector
    lora: LoraClient
    admission: Admission | None  # --max-concurrent-requests or --tenants; None: neither


def build_state(
    config: ProxyConfig,
    clock: Callable[[], float],
    metrics_registry: CollectorRegistry,
    rng: random.Random,
) -> AppState:
    registry = EndpointRegistry(clock)
    client = EngineClient(
        config.timeouts, config.pool, _bearer(config.engine_api_key), tls=config.engine_tls
    )
    metrics = ProxyMetrics(metrics_registry)
    core = _Core(
        registry=registry,
        client=client,
        metrics=metrics,
        connector=load_connector(config),
        outliers=OutlierDetector(config.outlier, clock),
        lora=LoraClient(registry=registry, client=client),
        admission=_admission(config, metrics, clock),
    )
    health = HealthChecker(
        config.health, registry=core.registry, client=core.client, outliers=core.outliers
    )
    release = KVRelease(
        connector=core.connector,
        client=core.client,
        registry=core.registry,
        outliers=core.outliers,
        metrics=core.metrics,
    )
    membership = Membership(
        config=config,
        registry=core.registry,
        client=core.client,
        connector=core.connector,
        metrics=core.metrics,
        health=health,
        clock=clock,
    )
    scheduler = _scheduler(config, core, clock, rng)
    budget = _retry_budget(config.retry, clock)  # fleet-wide: generation and pass-through
    orchestrator = _orchestrator(config, core, release, scheduler, budget, rng, clock)
    passthrough = _passthrough(config, core, scheduler, budget, rng)
    state = _app_state(config, core, orchestrator, passthrough, membership, health, release, clock)
    if config.render_once:
        state.render_once = _render_once(config, core, orchestrator, scheduler, budget, rng, clock)
    if config.scheduling.kv_events_endpoint is not None or scheduler.kv_events:
        state.kv_events = KVEventFleet(config.scheduling, core.registry, scheduler.kv_index)
    return state


def _orchestrator(
    config: ProxyConfig,
    core: _Core,
    release: KVRelease,
    scheduler: Scheduler,
    budget: RetryBudget,
    rng: random.Random,
    clock: Callable[[], float],
) -> Orchestrator:
    room = _leg_room(config, core.admission, clock)
    legs = Legs(
        connector=core.connector,
        client=core.client,
        timeouts=config.timeouts,
        verdicts=Verdicts(core.outliers, core.registry, core.metrics),
        metrics=core.metrics,
        kv_check=scheduler.verify_prefill if scheduler.kv_events else None,
        room=room,
    )
    flow = core.admission if config.tenants.enabled else None
    return Orchestrator(
        registry=core.registry,
        scheduler=scheduler,
        connector=core.connector,
        legs=legs,
        outliers=core.outliers,
        release=release,
        retry=config.retry,
        budget=budget,
        metrics=core.metrics,
        rng=rng,
        lora=_lora_on_demand(config, core, scheduler, clock),
        first_token=config.first_token_from_prefill,
        prompt_tokens=_prompt_tokens(config, scheduler, core.metrics),
        room=room,
        deadlines=None if flow is None else TtftPredictor(scheduler.speeds, flow.book, clock),
    )


def _admission(
    config: ProxyConfig, metrics: ProxyMetrics, clock: Callable[[], float]
) -> Admission | None:
    if not (config.admission.enabled or config.tenants.enabled):
        return None
    return Admission(config.admission, metrics, config.tenants, clock)


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
    config: ProxyConfig, core: _Core, scheduler: Scheduler, clock: Callable[[], float]
) -> LoraOnDemand | None:
    if not config.lora.load_on_demand:
        return None
    headers = {"content-type": "application/json"}
    if config.engine_api_key is not None:
        headers["authorization"] = f"Bearer {config.engine_api_key}"
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
    core: _Core,
    scheduler: Scheduler,
    budget: RetryBudget,
    rng: random.Random,
) -> Passthrough:
    return Passthrough(
        registry=core.registry,
        scheduler=scheduler,
        client=core.client,
        timeouts=config.timeouts,
        verdicts=Verdicts(core.outliers, core.registry, core.metrics),
        outliers=core.outliers,
        retry=config.retry,
        budget=budget,
        metrics=core.metrics,
        rng=rng,
    )


def _render_once(
    config: ProxyConfig,
    core: _Core,
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
    pool = (lambda: servers) if servers else None
    peers = (lambda _: servers) if servers else None
    render = Passthrough(
        registry=core.registry,
        scheduler=scheduler,
        client=core.client,
        timeouts=config.timeouts,
        verdicts=Verdicts(core.outliers, core.registry, core.metrics, peers),
        outliers=core.outliers,
        retry=config.retry,
        budget=budget,
        metrics=core.metrics,
        rng=rng,
        pool=pool,
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
    config: ProxyConfig, core: _Core, clock: Callable[[], float], rng: random.Random
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


def _app_state(
    config: ProxyConfig,
    core: _Core,
    orchestrator: Orchestrator,
    passthrough: Passthrough,
    membership: Membership,
    health: HealthChecker,
    release: KVRelease,
    clock: Callable[[], float],
) -> AppState:
    state = AppState(
        config,
        core.registry,
        core.client,
        core.metrics,
        orchestrator,
        membership,
        health,
        core.outliers,
        release,
        keys=ClientKeys(config.api_keys, config.key_tenants),
        lifecycle=Lifecycle(core.registry, lambda: state.in_flight),
        loads=LoadScraper(
            config.health,
            registry=core.registry,
            client=core.client,
            metrics=core.metrics,
            clock=clock,
        ),
        models=ModelReader(
            interval=config.health.models_interval,
            registry=core.registry,
            client=core.client,
            max_models=config.health.max_models,
        ),
        lora=core.lora,
        passthrough=passthrough,
        clock=clock,
        admission=core.admission,
        engine_authorization=_bearer(config.engine_api_key),
    )
    core.metrics.track_in_flight(lambda: state.in_flight)
    core.metrics.track_endpoint_in_flight(
        lambda: ((e.role.value, e.url, e.legs.in_flight) for e in core.registry.all())
    )
    return state


def _bearer(key: str | None) -> str | None:
    return None if key is None else f"Bearer {key}"


def _retry_budget(config: RetryConfig, clock: Callable[[], float]) -> RetryBudget:
    return RetryBudget(
        ratio=config.budget_ratio,
        window=config.budget_window,
        min_per_sec=config.budget_min_per_sec,
        clock=clock,
    )
