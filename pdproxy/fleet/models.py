"""The routable instances per served model: which prefills and decodes may take a request
for a model or LoRA adapter.

A prefill and a decode must run the same weights and adapter, or the decode reads KV it
cannot use (vLLM answers text that is neither model's, with no error). So a request's
pair is picked from the instances that *both* list its ``model`` in their ``/v1/models``.
An instance whose models are not known yet (a static one before its first read) may take
any model: the engine's own 404 is then the answer, as before per-model routing.

Built once per registry change (``EndpointRegistry.pools``); a request's lookup is one
dict hit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from pdproxy.errors import ModelNotFound, NoEndpointAvailable, clip
from pdproxy.types import Endpoint, Snapshot

EMPTY = Snapshot(prefill=(), decode=())


@dataclass(frozen=True, slots=True)
class ModelPools:
    """``by_model``: the routable instances of each model any routable instance lists;
    ``anyone``: the routable instances whose models are unknown; ``known``: every model an
    instance in the registry lists, routable or not (a 503, not a 404, when none is)."""

    everything: Snapshot
    by_model: Mapping[str, Snapshot]
    anyone: Snapshot
    known: frozenset[str]

    def lookup(self, model: str | None) -> Snapshot:
        """The instances that may serve ``model`` (all for None); empty when none may."""
        if model is None:
            return self.everything
        pool = self.by_model.get(model)
        if pool is not None:
            return pool
        return self.anyone

    def require(self, model: str | None) -> Snapshot:
        """``lookup``, or raises ``ModelNotFound`` (404: no instance serves it) or
        ``NoEndpointAvailable`` (503: the instances that serve it are not routable).
        An empty fleet knows no model: its answer stays the scheduler's 503."""
        pool = self.lookup(model)
        if pool.decode or model is None or not self.everything.decode:
            return pool  # (no decode at all: the scheduler's 503, whatever the model)
        if model in self.known:
            raise NoEndpointAvailable(f"no instance serving model {clip(model)!r} is available")
        raise ModelNotFound(model)


def build_pools(snapshot: Snapshot, registered: Iterable[Endpoint]) -> ModelPools:
    """The pools of ``snapshot`` (the routable instances) and the models ``registered``
    (every instance in the registry) list."""
    served = {e.url: frozenset(e.models) for e in (*snapshot.prefill, *snapshot.decode)}
    names = frozenset().union(*served.values())

    def serving(endpoints: tuple[Endpoint, ...], model: str) -> tuple[Endpoint, ...]:
        return tuple(e for e in endpoints if not served[e.url] or model in served[e.url])

    by_model = {
        m: Snapshot(prefill=serving(snapshot.prefill, m), decode=serving(snapshot.decode, m))
        for m in sorted(names)
    }
    anyone = Snapshot(
        prefill=tuple(e for e in snapshot.prefill if not served[e.url]),
        decode=tuple(e for e in snapshot.decode if not served[e.url]),
    )
    known = frozenset(m for e in registered for m in e.models)
    if len(by_model) == 1 and not anyone.prefill and not anyone.decode:
        only = next(iter(by_model))  # one model: its pool is the snapshot (the caches hold)
        if by_model[only] == snapshot:
            by_model[only] = snapshot
    return ModelPools(snapshot, by_model, anyone if anyone.decode else EMPTY, known)
