"""The live engine instances by role.

Soft state only: static instances come from the command line, registered ones re-announce
themselves every few seconds, so a restarted proxy converges without any stored state.
Mutated only on the event loop, so it needs no locks.

The registry is the one writer of each instance's ``Presence`` (admission state, lease, last
heartbeat) and the one that sets which records an ``Endpoint`` holds (a replacement carries
its predecessor's ``LegCounts`` over); ``tests/unit/test_record_owners.py`` holds it to that.
"""

from __future__ import annotations

from collections.abc import Callable

from pdproxy.fleet.models import ModelPools, build_pools
from pdproxy.types import Endpoint, EndpointState, Role, Snapshot


class EndpointRegistry:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._by_url: dict[str, Endpoint] = {}
        self._snapshot: Snapshot | None = None
        self._pools: ModelPools | None = None
        self._removal_listeners: list[Callable[[str], None]] = []
        self._replace_listeners: list[Callable[[Endpoint], None]] = []
        self._change_listeners: list[Callable[[], None]] = []

    def __len__(self) -> int:
        return len(self._by_url)

    def get(self, url: str) -> Endpoint | None:
        return self._by_url.get(url)

    def all(self) -> list[Endpoint]:
        return list(self._by_url.values())

    def add(self, endpoint: Endpoint, state: EndpointState | None = None) -> None:
        """Insert or replace the instance at ``endpoint.url`` (admitted in ``state``, if
        given). A replacement takes its predecessor's ``LegCounts`` over whole, not a copy:
        the legs in flight hold the old ``Endpoint`` and uncount themselves on that record,
        which is then the new one's (a copied count was never uncounted). The
        ``on_replace`` listeners hear of it (a new instance: none of its KV connections
        are known)."""
        previous = self._by_url.get(endpoint.url)
        if previous is not None:
            endpoint.legs = previous.legs
            for listener in self._replace_listeners:
                listener(endpoint)
        if state is not None:
            endpoint.presence.state = state
        self._by_url[endpoint.url] = endpoint
        self._changed()

    def on_replace(self, listener: Callable[[Endpoint], None]) -> None:
        """Call ``listener(endpoint)`` whenever an instance replaces another at its URL."""
        self._replace_listeners.append(listener)

    def on_removal(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(url)`` whenever an instance leaves (removed or expired)."""
        self._removal_listeners.append(listener)

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` whenever the membership or an instance's routability changes
        (an addition, a removal, a state or a health verdict): the workers' publisher."""
        self._change_listeners.append(listener)

    def seen(self, url: str, last_seen: float | None) -> None:
        """The instance was heard from at ``last_seen`` (wall clock); its lease is as it was."""
        self._by_url[url].presence.last_seen = last_seen

    def touch(self, url: str, ttl: float, last_seen: float) -> None:
        """Extend a registered instance's lease (a heartbeat)."""
        endpoint = self._by_url[url]
        endpoint.presence.expires_at = self._clock() + ttl
        endpoint.presence.last_seen = last_seen

    def set_state(self, url: str, state: EndpointState) -> None:
        self._by_url[url].presence.state = state
        self._changed()

    def remove(self, url: str) -> Endpoint | None:
        endpoint = self._by_url.pop(url, None)
        if endpoint is not None:
            self._changed()
            self._removed(url)
        return endpoint

    def expire(self) -> list[Endpoint]:
        """Drop every instance whose lease ran out; static ones never expire."""
        now = self._clock()
        dead = [
            e
            for e in self._by_url.values()
            if e.presence.expires_at is not None and e.presence.expires_at <= now
        ]
        for endpoint in dead:
            del self._by_url[endpoint.url]
        if dead:
            self._changed()
        for endpoint in dead:
            self._removed(endpoint.url)
        return dead

    def snapshot(self) -> Snapshot:
        """Routable instances by role; cached until the registry changes."""
        if self._snapshot is None:
            ready = [e for e in self._by_url.values() if e.routable]
            self._snapshot = Snapshot(
                prefill=tuple(e for e in ready if e.role is Role.PREFILL),
                decode=tuple(e for e in ready if e.role is Role.DECODE),
            )
        return self._snapshot

    def pools(self) -> ModelPools:
        """The snapshot's instances per served model; cached until the registry changes."""
        if self._pools is None:
            self._pools = build_pools(self.snapshot(), self._by_url.values())
        return self._pools

    def invalidate(self) -> None:
        """An endpoint's routability or models changed in place (its health, a re-read of
        its ``/v1/models``): rebuild the snapshot."""
        self._changed()

    def _changed(self) -> None:
        self._snapshot = None
        self._pools = None
        for listener in self._change_listeners:
            listener()

    def _removed(self, url: str) -> None:
        for listener in self._removal_listeners:
            listener(url)
