"""Consistent hashing of session keys onto instances.

Each instance owns ``vnodes`` points on a 64-bit ring (a stable hash of its URL and the
point's number); a key belongs to the first point at or after its own hash. A joining or
leaving instance therefore moves only the keys of the arcs it gains or loses, about
``1/n`` of them. Hashes are BLAKE2b, stable across processes and machines, so replicas of
pdproxy agree on every key's instance.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import OrderedDict
from collections.abc import Sequence

from pdproxy.scheduling.view import EndpointView

_VNODES = 256  # ~1/16 spread in each instance's share; a ring of 64 instances builds in ~25 ms
_CACHED_RINGS = 8


def stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    def __init__(self, endpoints: Sequence[EndpointView], vnodes: int = _VNODES) -> None:
        by_url = {e.url: e for e in endpoints}
        points = sorted((stable_hash(f"{url}#{i}"), url) for url in by_url for i in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._owners = [by_url[u] for _, u in points]

    def owner(self, key: str) -> EndpointView:
        index = bisect.bisect_left(self._hashes, stable_hash(key))
        return self._owners[index % len(self._owners)]


class HashRings:
    """Rings by instance set, built once per set and kept for the few latest sets (the
    candidates change only when membership or health does)."""

    def __init__(self, vnodes: int = _VNODES) -> None:
        self._vnodes = vnodes
        self._rings: OrderedDict[tuple[str, ...], HashRing] = OrderedDict()
        self._last: tuple[Sequence[EndpointView], HashRing] | None = None

    def owner(self, key: str, endpoints: Sequence[EndpointView]) -> EndpointView:
        last = self._last
        if last is not None and last[0] is endpoints:  # the same snapshot as last time
            return last[1].owner(key)
        urls = tuple(e.url for e in endpoints)
        ring = self._rings.get(urls)
        if ring is None:
            ring = self._rings[urls] = HashRing(endpoints, self._vnodes)
            if len(self._rings) > _CACHED_RINGS:
                self._rings.popitem(last=False)
        else:
            self._rings.move_to_end(urls)
        self._last = (endpoints, ring)
        return ring.owner(key)
