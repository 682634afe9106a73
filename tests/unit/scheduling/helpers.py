from __future__ import annotations

import random

from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.scheduling.context import Context, RequestFeatures
from pdproxy.scheduling.scheduler import Scheduler
from pdproxy.types import Endpoint, EngineAddress, EngineLoad, RankLoad, Role, Snapshot, Source

NOW = 1000.0


def endpoint(url: str, role: Role = Role.DECODE, *, in_flight: int = 0, dp: int = 1, models=()):
    address = EngineAddress(url=url, dp_size=dp)
    e = Endpoint.new(role=role, address=address, source=Source.STATIC, models=tuple(models))
    e.legs.in_flight = in_flight
    e.legs.work = float(in_flight)
    return e


def with_load(e: Endpoint, running=0.0, waiting=0.0, kv=0.0, age=0.0, ranks=()) -> Endpoint:
    """Figures as the scraper leaves them, read ``age`` seconds ago (fresh for 3 s)."""
    load = EngineLoad(running, waiting, kv, NOW - age, tuple(RankLoad(*r) for r in ranks))
    e.load.engine_load = load
    e.load.others, e.load.others_until = load.others, load.scraped_at + 3.0
    return e


def ctx(features: RequestFeatures | None = None, max_age: float = 3.0) -> Context:
    return Context(features or RequestFeatures(), NOW, max_age)


def scheduler(seed: int = 0, **config) -> Scheduler:
    return Scheduler(
        SchedulingConfig(**config), clock=lambda: NOW, rng=random.Random(seed), max_age=3.0
    )


def fleet(n_p: int, n_d: int) -> Snapshot:
    return Snapshot(
        tuple(endpoint(f"http://p{i}:1", Role.PREFILL) for i in range(n_p)),
        tuple(endpoint(f"http://d{i}:1") for i in range(n_d)),
    )
