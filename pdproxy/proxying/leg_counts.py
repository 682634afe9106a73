"""The one writer of each instance's ``LegCounts``: a leg is counted on its endpoint
(``enter``/``leave``), a decode awaiting its prefill is reserved (``reserve``/``unreserve``),
and the KV sources a decode reads from are learned and forgotten here; everyone else reads
them. ``tests/unit/test_record_owners.py`` holds it to that."""

from __future__ import annotations

from pdproxy.types import Endpoint


def enter(endpoint: Endpoint, rank: int | None, weight: float = 1.0, tokens: float = 0.0) -> None:
    """Count a leg on ``endpoint`` (and its DP rank) while it runs; ``weight`` is its size
    for the scheduler (a prefill's prompt over the typical one), ``tokens`` the prompt
    tokens a prefill leg has to compute (``LegCounts.queued_tokens``)."""
    endpoint.legs.in_flight += 1
    endpoint.legs.work += weight
    endpoint.legs.queued_tokens += tokens
    if rank is not None:
        counts = endpoint.legs.rank_in_flight
        if len(counts) <= rank:
            counts.extend([0] * (rank + 1 - len(counts)))
        counts[rank] += 1


def leave(endpoint: Endpoint, rank: int | None, weight: float = 1.0, tokens: float = 0.0) -> None:
    legs = endpoint.legs
    legs.in_flight -= 1
    idle = not legs.in_flight and not legs.reserved
    legs.work = 0.0 if idle else legs.work - weight  # no float drift
    legs.queued_tokens = 0.0 if not legs.in_flight else max(legs.queued_tokens - tokens, 0.0)
    if rank is not None and rank < len(endpoint.legs.rank_in_flight):
        endpoint.legs.rank_in_flight[rank] -= 1


def reserve(decode: Endpoint) -> None:
    """Count a request on ``decode`` before its leg starts (it awaits its prefill)."""
    decode.legs.reserved += 1
    decode.legs.work += 1.0


def unreserve(decode: Endpoint) -> None:
    """The reservation ``reserve`` made ends (its leg started, or the request did)."""
    legs = decode.legs
    legs.reserved -= 1
    legs.work = legs.work - 1.0 if legs.in_flight or legs.reserved else 0.0  # no float drift


def read_from(decode: Endpoint, source: str) -> None:
    """``decode`` read KV from ``source`` (a prefill's engine id): a release via it is prompt."""
    decode.legs.read_from(source)


def forget_kv_source(decode: Endpoint, source: str) -> None:
    """``decode`` did not act as one reading from ``source`` would (a release it failed)."""
    decode.legs.kv_sources.pop(source, None)


def forget_kv_sources(endpoint: Endpoint) -> None:
    """Its KV connections are gone (a restart, a verdict of the health book): the health
    book's ``on_connections_lost`` listener, wired by ``pdproxy.build``."""
    endpoint.legs.kv_sources.clear()
