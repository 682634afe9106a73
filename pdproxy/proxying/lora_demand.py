"""``--lora-load-on-demand``: a request for a ``--lora-modules`` adapter that no routable
pair holds loads it on a prefill and a decode first, through vLLM's runtime LoRA API.

Affinity comes from the per-model pools (``pdproxy.fleet.models``): an adapter's requests
go only to the instances that hold it, so a pair that loaded it keeps its traffic and the
engines' adapter slots are not churned. When no routable decode holds it, or when every
decode holding it is overloaded next to the least busy one that does not (a hot adapter:
the overload filter's ``--balance-abs-threshold`` and ``--balance-rel-threshold``), a pair
that does not hold it is chosen, as the policies choose any pair, the prefill among the
instances that share a model with the chosen decode (its base), and the adapter loaded on
both at once; the request that saw the need waits for the load, the others go on to the
holders.
Concurrent requests for one adapter wait for the same load. With ``--max-loras N``, an
instance already holding N adapters pdproxy loaded there first unloads the one least
recently requested (an eviction). A load that fails fails the request with the engine's
answer (an unknown path: vLLM's 404 or 400), or 503 when the engine cannot be reached.
Loads and evictions are counted (``LoraCounts``, ``/status``).

Cost when the flag is off: none (the orchestrator holds no ``LoraOnDemand``); when on, a
dict lookup per request, and a pools lookup for the adapters it names.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping

import orjson

from pdproxy.config.lora import LoraConfig
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.proxying.lora import UNLOAD, LoraClient
from pdproxy.resilience.outlier import OutlierDetector
from pdproxy.scheduling.context import RequestFeatures
from pdproxy.scheduling.scheduler import Scheduler
from pdproxy.types import Endpoint, Role

logger = logging.getLogger(__name__)


class LoraOnDemand:
    def __init__(
        self,
        config: LoraConfig,
        *,
        registry: EndpointRegistry,
        lora: LoraClient,
        scheduler: Scheduler,
        outliers: OutlierDetector,
        headers: Mapping[str, str],
        clock: Callable[[], float],
        spread_at: tuple[float, float] = (4.0, 1.5),
    ) -> None:
        self._paths = config.paths
        # (abs, rel): holders busier than this over the least busy other decode (the
        # overload filter's --balance-abs-threshold and --balance-rel-threshold)
        self._spread_abs, self._spread_rel = spread_at
        self._max = config.max_loras
        self._registry = registry
        self._lora = lora
        self._scheduler = scheduler
        self._outliers = outliers
        self._headers = headers
        self._clock = clock
        self._loading: dict[str, asyncio.Future[None]] = {}
        self._held: dict[str, dict[str, None]] = {}  # url -> adapters pdproxy loaded there
        self._last_used: dict[str, float] = {}  # adapter -> when a request last named it
        registry.on_removal(self._forget)

    async def ensure(self, features: RequestFeatures) -> None:
        """Make sure a routable pair holds the request's adapter (a no-op for any other
        model); raises ``UpstreamError`` when loading it failed."""
        model = features.model
        if model is None or model not in self._paths:
            return
        self._last_used[model] = self._clock()
        holders = self._registry.pools().lookup(model).decode
        if holders and (model in self._loading or not self._hot(model, holders)):
            return  # (a spread under way: this request goes to a holder)
        pending = self._loading.get(model)
        if pending is None:
            pending = asyncio.ensure_future(self._load_on_a_pair(model, features))
            self._loading[model] = pending
            pending.add_done_callback(lambda _: self._loading.pop(model, None))
        await asyncio.shield(pending)  # one client leaving does not cancel the others' load

    def _hot(self, name: str, holders: tuple[Endpoint, ...]) -> bool:
        """Whether every decode holding adapter ``name`` is overloaded next to the least
        busy decode that does not: then a second pair gets it (a hot adapter spreads)."""
        others = [e.legs.work for e in self._registry.snapshot().decode if name not in e.models]
        if not others:
            return False
        floor = min(others) + 1.0
        least = min(e.legs.work for e in holders) + 1.0
        return least > floor + self._spread_abs and least > floor * self._spread_rel

    async def _load_on_a_pair(self, name: str, features: RequestFeatures) -> None:
        """Load ``name`` on a decode that does not hold it and on a prefill that agrees
        with it (one that does not hold it either, if there is one)."""
        snapshot = self._registry.snapshot()
        anyone = dataclasses.replace(features, model=None)
        decodes = tuple(d for d in snapshot.decode if name not in d.models)
        decode, _ = self._scheduler.pick(Role.DECODE, anyone, self._outliers.usable(decodes))
        prefills = tuple(p for p in snapshot.prefill if _agree(p, decode))
        fresh = tuple(p for p in prefills if name not in p.models)
        targets = [decode]
        if prefills:
            prefill = self._scheduler.pick(
                Role.PREFILL, anyone, self._outliers.usable(fresh or prefills)
            )[0]
            if name not in prefill.models:
                targets.append(prefill)
        logger.info("loading %s on demand on %s", name, ", ".join(e.url for e in targets))
        await asyncio.gather(*(self._load_on(e, name) for e in targets))

    async def _load_on(self, endpoint: Endpoint, name: str) -> None:
        held = self._held.setdefault(endpoint.url, {})
        if self._max and len(held) >= self._max:
            await self._evict(endpoint, held)
        await self._lora.load(endpoint, name, self._paths[name], self._headers)
        held[name] = None

    async def _evict(self, endpoint: Endpoint, held: dict[str, None]) -> None:
        """Unload the adapter pdproxy loaded on ``endpoint`` that was requested longest ago."""
        victim = min(held, key=lambda n: self._last_used.get(n, 0.0))
        del held[victim]
        body = orjson.dumps({"lora_name": victim})
        answer = await self._lora.call(endpoint, UNLOAD, body, self._headers)
        self._lora.counts.evictions += 1
        logger.info("evicted %s from %s (HTTP %d)", victim, endpoint.url, answer.status)

    def _forget(self, url: str) -> None:
        self._held.pop(url, None)


def _agree(prefill: Endpoint, decode: Endpoint) -> bool:
    """Whether ``prefill`` runs a model ``decode`` runs (the adapter's base), or either's
    models are not known yet."""
    return (
        not prefill.models or not decode.models or not set(prefill.models).isdisjoint(decode.models)
    )
