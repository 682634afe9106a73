"""Model routing micro-benchmark (part of `make bench`): what routing by ``model`` costs per
request, in a single-model fleet and in one of 10 base models and 50 LoRA adapters, and
what rebuilding the per-model pools costs when the registry changes.

Per request, the orchestrator looks the request's model up in the registry's pools (one
dict hit) and the scheduler picks a pair among them; before routing by model it took the
registry's snapshot and its model filter scanned it. Pure CPU, no I/O, in process CPU
time, best of 15 rounds taken in turns (timeit's rule).

    python -m bench.model_routing [--instances 40] [--requests 5000]
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.fleet.models import build_pools
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.scheduling.context import RequestFeatures
from pdproxy.scheduling.scheduler import Scheduler
from pdproxy.types import Endpoint, EngineAddress, Role, Source

_ROUNDS = 5
_INTERLEAVED = 15
NOW = 1000.0
BASES, ADAPTERS = 10, 50


def _registry(instances: int, models: Callable[[int], tuple[str, ...]]) -> EndpointRegistry:
    registry = EndpointRegistry(lambda: NOW)
    for i in range(instances):
        registry.add(
            Endpoint.new(
                role=Role.PREFILL if i % 2 == 0 else Role.DECODE,
                address=EngineAddress(url=f"http://10.0.0.{i}:8000"),
                source=Source.STATIC,
                models=models(i // 2),
            )
        )
    return registry


def _many(pair: int) -> tuple[str, ...]:
    """Pair ``pair`` serves one of the 10 bases and that base's 5 adapters."""
    base = pair % BASES
    return (f"base-{base}", *(f"lora-{base}-{a}" for a in range(ADAPTERS // BASES)))


def _names(registry: EndpointRegistry) -> list[str]:
    return sorted(registry.pools().by_model)


def _best(run: Callable[[], None], n: int) -> float:
    costs = []
    for _ in range(_ROUNDS):
        started = time.process_time()
        run()
        costs.append((time.process_time() - started) / n * 1e6)
    return min(costs)


def per_request(registry: EndpointRegistry, requests: int) -> tuple[float, ...]:
    """(µs for the pools lookup, µs for lookup + a least-loaded pair, µs for the snapshot +
    a pair as before routing by model)."""
    rng = random.Random(3)
    names = _names(registry)
    features = [RequestFeatures(model=rng.choice(names)) for _ in range(requests)]
    config = SchedulingConfig(prefill_policy="least-loaded", decode_policy="least-loaded")
    scheduler = Scheduler(config, clock=lambda: NOW, rng=random.Random(1), max_age=3.0)

    def lookup() -> None:
        for f in features:
            registry.pools().require(f.model)

    def routed() -> None:
        for f in features:
            scheduler.schedule(f, registry.pools().require(f.model))

    def before() -> None:
        for f in features:
            scheduler.schedule(f, registry.snapshot())

    return _interleaved((lookup, routed, before), requests)


def _interleaved(runs: tuple[Callable[[], None], ...], n: int) -> tuple[float, ...]:
    """The best of ``_INTERLEAVED`` rounds of each, the runs taking turns within a round, so
    that a busy spell of the machine does not land on one of them only."""
    costs: list[list[float]] = [[] for _ in runs]
    for _ in range(_INTERLEAVED):
        for run, cost in zip(runs, costs, strict=True):
            started = time.process_time()
            run()
            cost.append((time.process_time() - started) / n * 1e6)
    return tuple(min(c) for c in costs)


def rebuild(registry: EndpointRegistry) -> float:
    """µs to rebuild the pools after a registry change."""
    snapshot, everyone = registry.snapshot(), registry.all()
    return _best(lambda: [build_pools(snapshot, everyone) for _ in range(100)], 100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--instances", type=int, default=40, help="half prefills, half decodes")
    p.add_argument("--requests", type=int, default=5000, help="per round (15 rounds)")
    a = p.parse_args(argv)
    fleets = (
        ("one model", _registry(a.instances, lambda _: ("m",))),
        (f"{BASES} models + {ADAPTERS} adapters", _registry(a.instances, _many)),
    )
    print(f"\n## Model routing, {a.instances} instances ({a.requests} requests)\n")
    print(
        "| fleet | models | µs pools lookup | µs lookup + pair | µs snapshot + pair (before)"
        " | µs pools rebuild |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, registry in fleets:
        lookup, routed, before = per_request(registry, a.requests)
        served = len(registry.pools().by_model)
        print(
            f"| {name} | {served} | {lookup:.2f} | {routed:.1f} | {before:.1f}"
            f" | {rebuild(registry):.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
