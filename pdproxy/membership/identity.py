"""An instance's identity re-read: the one writer of ``Endpoint.identity``.

What an instance is (``EndpointIdentity``: its role, address, source, models and engine ids)
is fixed at admission. A probe that learns its models or engine ids (``InstanceChecks``,
``ModelReader``), the owner's snapshot under ``--workers`` (``workers.link``) and a LoRA
adapter loaded or unloaded through pdproxy (``proxying.lora``, handed ``relabel`` by
``pdproxy.build``) make a new identity here; none edits one.
``tests/unit/test_record_owners.py`` holds every other module to that.
"""

from __future__ import annotations

from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.types import Endpoint, EndpointIdentity, Source


def reidentify(
    endpoint: Endpoint,
    *,
    source: Source | None = None,
    models: tuple[str, ...] | None = None,
    engine_ids: tuple[str, ...] | None = None,
) -> None:
    """A new identity for ``endpoint`` with what was learned; its live records are kept.
    The caller rebuilds the registry's pools when the instance is in it."""
    old = endpoint.identity
    endpoint.identity = EndpointIdentity(
        role=old.role,
        address=old.address,
        source=old.source if source is None else source,
        models=old.models if models is None else models,
        engine_ids=old.engine_ids if engine_ids is None else engine_ids,
    )


def relabel(registry: EndpointRegistry, endpoint: Endpoint, models: tuple[str, ...]) -> None:
    """``endpoint`` serves ``models`` now (a LoRA adapter loaded or unloaded through
    pdproxy): re-identified at once if it is still the registry's and they changed, its
    pools rebuilt; the next ``/v1/models`` re-read confirms it."""
    if registry.get(endpoint.url) is endpoint and models != endpoint.models:
        reidentify(endpoint, models=models)
        registry.invalidate()
