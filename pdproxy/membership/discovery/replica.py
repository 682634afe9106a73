"""One replica's side of the shared registry, without any etcd I/O.

It hears what this replica learns by itself (a ``MembershipObserver``) and turns it into
writes: the claims this replica should hold (``own``: one per instance it hears heartbeats
from, declarative, rewritten whole after an outage) and the admin API's additions and
removals (``outbox``: imperative, written in order). It takes the shared registry's
entries, as the watch delivers them or a full read returns them, and applies them through
``Membership``'s entry points (``learn``, ``forget``, ``drain(announce=False)``), so an
instance another replica announced goes through the same checks as any other.

No echo: what it applies from the shared registry is not heard back as learned here, and a
replica's own claims are never a reason for it to act.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass

from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.membership.discovery.shared import (
    Action,
    Entry,
    Key,
    Keys,
    Kind,
    Learned,
    Local,
    Record,
    decide,
    shared_view,
)
from pdproxy.membership.membership import Membership
from pdproxy.types import Endpoint, EndpointState, Source

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Write:
    """An admin API change to publish: an addition (``record``) or a removal (None)."""

    url: str
    record: Record | None


class ReplicaView:
    def __init__(
        self, replica: str, keys: Keys, membership: Membership, registry: EndpointRegistry
    ) -> None:
        self.replica = replica
        self.keys = keys
        self._membership = membership
        self._registry = registry
        self._entries: dict[str, dict[Key, Entry]] = {}  # url -> the shared entries on it
        self.own: dict[str, Record] = {}  # url -> the claim this replica should hold
        self.dirty: set[str] = set()  # own claims to (re)write or delete
        self.outbox: deque[Write] = deque()
        self._learned: dict[str, Learned] = {}
        self._admitted: dict[str, Endpoint] = {}  # what ``learn`` returned, by url
        self.wake = asyncio.Event()  # set when there is something to write
        membership.observe(self)
        registry.on_removal(self._left)

    @property
    def pending(self) -> int:
        return len(self.outbox) + len(self.dirty)

    # -- what this replica learns by itself (MembershipObserver) -------------------------

    def heard(self, endpoint: Endpoint) -> None:
        if endpoint.source is not Source.REGISTERED:
            return
        url = endpoint.url
        own = self.own.get(url)
        if own is not None and own.same_instance(endpoint.role, endpoint.address, own.source):
            return  # the steady state: one dict lookup per heartbeat, no write
        self.own[url] = Record(endpoint.role, endpoint.address, Source.REGISTERED, self.replica)
        self._unlearn(url)  # heard here: this replica's own from now on
        self._mark(url)

    def added(self, endpoint: Endpoint) -> None:
        record = Record(endpoint.role, endpoint.address, Source.ADMIN, self.replica)
        self._unlearn(endpoint.url)
        self.outbox.append(Write(endpoint.url, record))
        self.wake.set()

    def drained(self, url: str) -> None:
        self.own.pop(url, None)
        self.dirty.discard(url)  # the removal deletes every claim on it, this one included
        self.outbox.append(Write(url, None))
        self.wake.set()

    def expired(self, url: str) -> None:
        if self.own.pop(url, None) is not None:
            self._mark(url)
        self._unlearn(url)  # another replica's claim on it may now be followed again

    def _mark(self, url: str) -> None:
        self.dirty.add(url)
        self.wake.set()

    def _unlearn(self, url: str) -> None:
        self._learned.pop(url, None)
        self._admitted.pop(url, None)

    def _left(self, url: str) -> None:
        """An instance left the registry (drained, expired, refused): once the change that
        removed it is done, see whether a claim on it should be followed now."""
        asyncio.get_running_loop().call_soon(self.reconcile, url)

    # -- what the shared registry says ---------------------------------------------------

    def replace_all(self, entries: dict[str, Entry]) -> None:
        """A full read (``key -> entry``): the shared view is exactly that, then every
        instance either side knows is reconciled."""
        previous = set(self._entries) | set(self._admitted)
        self._entries = {}
        for raw, entry in entries.items():
            key = self.keys.parse(raw)
            if key is not None:
                self._entries.setdefault(key.url, {})[key] = entry
        for url in previous | set(self._entries):
            self.reconcile(url)

    def put(self, raw: str, entry: Entry) -> None:
        key = self.keys.parse(raw)
        if key is not None:
            self._entries.setdefault(key.url, {})[key] = entry
            self.reconcile(key.url)

    def delete(self, raw: str) -> None:
        key = self.keys.parse(raw)
        if key is None:
            return
        on_url = self._entries.get(key.url, {})
        on_url.pop(key, None)
        if not on_url:
            self._entries.pop(key.url, None)
        if key.kind is Kind.SEEN and key.replica == self.replica and key.url in self.own:
            self._mark(key.url)  # deleted behind its back (its lease lost?): write it again
        self.reconcile(key.url)

    def own_in_store(self) -> dict[str, int]:
        """This replica's claims as the shared registry holds them: url -> revision."""
        return {
            key.url: entry.revision
            for on_url in self._entries.values()
            for key, entry in on_url.items()
            if key.kind is Kind.SEEN and key.replica == self.replica
        }

    def reconcile(self, url: str) -> None:
        """Bring this replica's view of ``url`` in line with the shared registry; one bad
        entry must not stop the others (the watch goes on)."""
        try:
            self._reconcile(url)
        except Exception:
            logger.exception("shared registry: could not apply the entries on %s", url)

    def _reconcile(self, url: str) -> None:
        view = shared_view(self._entries.get(url, {}), self.replica)
        local = self._local(url)
        action = decide(view, local, self._learned.get(url))
        record = view.record
        if action is Action.LEARN and record is not None:
            endpoint = self._membership.learn(record.role, record.address, record.source)
            self._learned[url] = Learned(record, view.revision)  # refused: not again
            if endpoint is None:
                self._admitted.pop(url, None)
            else:
                self._admitted[url] = endpoint
        elif action is Action.DRAIN:
            self.own.pop(url, None)
            self.dirty.discard(url)
            self._unlearn(url)
            self._membership.drain(url, announce=False)
        elif action is Action.FORGET:
            self._unlearn(url)
            self._membership.forget(url)
        elif local is Local.LEARNED and record is not None:
            self._learned[url] = Learned(record, view.revision)  # rewritten, unchanged

    def _local(self, url: str) -> Local:
        endpoint = self._registry.get(url)
        if endpoint is None:
            return Local.ABSENT
        if endpoint.state is EndpointState.DRAINING:
            return Local.DRAINING
        if self._admitted.get(url) is endpoint and endpoint.presence.expires_at is None:
            return Local.LEARNED
        return Local.OWN

    def counts(self) -> dict[str, int]:
        """For ``/status``: instances in the shared registry, and those learned from it."""
        shared = sum(
            1
            for on_url in self._entries.values()
            if any(k.kind is not Kind.REMOVED for k in on_url)
            and not any(k.kind is Kind.REMOVED for k in on_url)
        )
        learned = sum(1 for url in self._admitted if self._local(url) is Local.LEARNED)
        return {
            "shared_instances": shared,
            "learned_instances": learned,
            "own_claims": len(self.own),
        }
