"""The shared registry on etcd (``--registry-backend etcd://host:port[,...]``), through
``aetcd`` (asyncio gRPC, the ``etcd`` extra). Imported only when that backend is chosen.

One session at a time with one etcd member, tried in turn: a lease for this replica (the
registry TTL, kept alive every third of it), then, in this order, the admin changes
queued while etcd was away, a full read of the prefix (applied through ``ReplicaView``),
this replica's claims rewritten against what that read showed, and a watch from the read's
revision on. Heartbeats cost etcd nothing: a claim is written when an instance first
appears here or changes, deleted when it expires here, and the lease's keep-alive carries
them all. A replica that stops or loses etcd for a TTL loses its claims with its lease; it
does not revoke it when it stops cleanly, so the claims bridge the engines' reconnection to
another replica (their next heartbeat) instead of leaving a gap in every replica's fleet.

When etcd is unreachable, the session ends, the registry keeps the membership it last saw
(``pdproxy_registry_backend_up`` 0, ``/status`` says so), and a new session is tried with
a growing backoff; its full read reconciles whatever changed meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any

import aetcd
from aetcd.utils import prefix_range_end

from pdproxy.config.registry import SharedRegistryConfig
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.membership.discovery.replica import ReplicaView, Write
from pdproxy.membership.discovery.shared import (
    Entry,
    Keys,
    decode,
    encode,
    lease_ttl,
    tombstone_ttl,
)
from pdproxy.membership.membership import Membership
from pdproxy.observability.log import RateLimitedLogger
from pdproxy.observability.metrics import ProxyMetrics

logger = logging.getLogger(__name__)

_RPC_TIMEOUT = 2  # seconds, each call: a dead member is noticed that fast
_BACKOFF_MIN, _BACKOFF_MAX = 0.2, 5.0  # between sessions, doubling, with jitter
_FIRST_SYNC = 3.0  # start() waits this long for the first full read, then serves anyway
_GRPC_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 200,
    "grpc.max_reconnect_backoff_ms": 2000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
}


class LeaseLost(Exception):
    """etcd no longer knows this replica's lease: its claims are gone, write them again."""


def default_replica_id() -> str:
    """The pod's (host's) name, the process, and a random tail: unique per process."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class EtcdRegistry:
    def __init__(
        self,
        config: SharedRegistryConfig,
        *,
        registry_ttl: float,
        membership: Membership,
        registry: EndpointRegistry,
        metrics: ProxyMetrics,
        replica: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        self._keys = Keys(config.prefix)
        self._prefix = config.prefix.encode()
        self._lease_ttl = lease_ttl(registry_ttl)
        self._tombstone_ttl = tombstone_ttl(registry_ttl)
        self.view = ReplicaView(replica or default_replica_id(), self._keys, membership, registry)
        self._metrics = metrics
        self._clock = clock
        self._log = RateLimitedLogger(logger, clock)
        self._lease: int | None = None
        self._member = 0  # index into config.etcd of the member tried next
        self._up = False
        self._synced_at: float | None = None
        self._created = clock()
        self._revision = 0
        self._error: str | None = None
        self._first_sync = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        metrics.registry_backend_up.set(0)
        metrics.registry_backend_sync_age.set_function(self._sync_age)
        metrics.registry_backend_pending.set_function(lambda: self.view.pending)

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Start syncing; wait a bounded time for the first full read, so a restarted
        replica serves the fleet it had rather than an empty registry."""
        self._task = asyncio.create_task(self._run(), name="pdproxy-etcd-registry")
        try:
            await asyncio.wait_for(self._first_sync.wait(), _FIRST_SYNC)
        except asyncio.TimeoutError:
            logger.warning(
                "shared registry: etcd %s not reachable yet; serving without it, retrying",
                self._members(),
            )

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def status(self) -> dict[str, Any]:
        return {
            "backend": "etcd",
            "endpoints": self._members(),
            "prefix": self._config.prefix,
            "replica": self.view.replica,
            "up": self._up,
            "sync_age_s": None if self._synced_at is None else round(self._sync_age(), 3),
            "revision": self._revision,
            "lease_ttl_s": self._lease_ttl,
            "pending_writes": self.view.pending,
            "last_error": self._error,
            **self.view.counts(),
        }

    def _members(self) -> list[str]:
        return [f"{host}:{port}" for host, port in self._config.etcd]

    def _sync_age(self) -> float:
        """Since the last exchange with etcd; before the first, since this replica began."""
        since = self._created if self._synced_at is None else self._synced_at
        return max(0.0, self._clock() - since)

    def _synced(self, revision: int | None = None) -> None:
        self._synced_at = self._clock()
        if revision is not None:
            self._revision = max(self._revision, revision)

    # -- sessions ------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = _BACKOFF_MIN
        while True:
            host, port = self._config.etcd[self._member % len(self._config.etcd)]
            started = self._clock()
            try:
                await self._session(host, port)
            except Exception as exc:  # any failure ends the session; the next one resyncs
                self._down(host, port, exc)
            if self._clock() - started > 2 * _BACKOFF_MAX:
                backoff = _BACKOFF_MIN  # that session had been healthy for a while
            self._member += 1
            await asyncio.sleep(backoff * random.uniform(0.8, 1.2))
            backoff = min(backoff * 2, _BACKOFF_MAX)

    def _down(self, host: str, port: int, exc: Exception) -> None:
        was_up, self._up = self._up, False
        self._metrics.registry_backend_up.set(0)
        self._error = f"{host}:{port}: {type(exc).__name__}: {exc}"[:300]
        if was_up:
            logger.warning(
                "shared registry: lost etcd %s:%d (%s); serving the last membership seen",
                host,
                port,
                self._error,
            )
        else:
            self._log.warning("etcd-down", "shared registry: etcd unreachable: %s", self._error)

    async def _session(self, host: str, port: int) -> None:
        client = aetcd.Client(host, port, timeout=_RPC_TIMEOUT, options=_GRPC_OPTIONS)
        try:
            await client.connect()
            await self._open_lease(client)
            await self._flush(client, claims=False)  # removals made meanwhile, before the read
            revision = await self._resync(client)
            watch = await client.watch_prefix(self._prefix, start_revision=revision + 1)
            self._up = True
            self._error = None
            self._metrics.registry_backend_up.set(1)
            self._metrics.registry_backend_resyncs.inc()
            self._first_sync.set()
            logger.info(
                "shared registry: in sync with etcd %s:%d at revision %d (%d claims of mine)",
                host,
                port,
                revision,
                len(self.view.own),
            )
            await _first_failure(self._keepalive(client), self._watch(watch), self._writer(client))
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), _RPC_TIMEOUT)

    async def _open_lease(self, client: Any) -> None:
        """Keep the lease when etcd still has it (an etcd restart keeps leases), else take
        a new one; the claims on a lost lease are gone and ``_resync`` writes them again."""
        if self._lease is not None:
            reply = await client.refresh_lease(self._lease)
            if reply is not None and reply.TTL > 0:
                return
        lease = await client.lease(self._lease_ttl)
        self._lease = lease.id

    async def _resync(self, client: Any) -> int:
        """Read the whole prefix, apply it, then make this replica's claims what it hears."""
        answer = await client.get_prefix(self._prefix)
        revision: int = answer.header.revision
        self._synced(revision)
        entries: dict[str, Entry] = {}
        leases: dict[str, int] = {}
        for kv in answer:
            key = kv.key.decode("utf-8", "replace")
            entries[key] = self._entry(key, kv.value, kv.mod_revision)
            leases[key] = kv.lease
        self.view.replace_all(entries)
        present = self.view.own_in_store()
        for url in set(present) | set(self.view.own):
            record = self.view.own.get(url)
            stored = entries.get(self._keys.seen(url, self.view.replica))
            fresh = (
                record is not None
                and stored is not None
                and stored.record == record
                and leases.get(self._keys.seen(url, self.view.replica)) == self._lease
            )
            if not fresh:
                self.view.dirty.add(url)
        await self._flush(client)
        return revision

    def _entry(self, key: str, value: bytes, revision: int) -> Entry:
        if key.startswith(self._keys.prefix + "removed/"):
            return Entry(None, revision)
        try:
            return Entry(decode(value), revision)
        except ValueError as exc:
            self._log.warning("value:" + key, "shared registry: ignored %s: %s", key, exc)
            return Entry(None, revision)

    async def _keepalive(self, client: Any) -> None:
        while True:
            await asyncio.sleep(self._lease_ttl / 3)
            reply = await client.refresh_lease(self._lease)
            if reply is None or reply.TTL <= 0:
                lost, self._lease = self._lease, None
                raise LeaseLost(f"lease {lost} expired")
            self._synced(reply.header.revision)

    async def _watch(self, watch: Any) -> None:
        async for event in watch:
            key = event.kv.key.decode("utf-8", "replace")
            if event.kind == aetcd.EventKind.PUT:
                self.view.put(key, self._entry(key, event.kv.value, event.kv.mod_revision))
            else:
                self.view.delete(key)
            self._synced(event.kv.mod_revision)
        raise ConnectionError("the watch ended")

    async def _writer(self, client: Any) -> None:
        while True:
            await self.view.wake.wait()
            self.view.wake.clear()
            await self._flush(client)

    async def _flush(self, client: Any, *, claims: bool = True) -> None:
        """The admin changes in order, then (``claims``) this replica's claims; each is
        dropped from the queue only once etcd took it."""
        view, tx = self.view, client.transactions
        while view.outbox:
            await self._publish(client, view.outbox[0])
            view.outbox.popleft()
        while claims and view.dirty:
            url = view.dirty.pop()
            record = view.own.get(url)
            key = self._keys.seen(url, view.replica).encode()
            try:
                if record is None:
                    await client.delete(key)
                else:  # a heartbeat heard anew supersedes an older removal
                    ops = [tx.delete(self._keys.removed(url).encode())]
                    ops.append(tx.put(key, encode(record), lease=self._lease))
                    await client.transaction(compare=[], success=ops, failure=[])
            except BaseException:
                view.dirty.add(url)
                raise
        self._synced()

    async def _publish(self, client: Any, write: Write) -> None:
        tx = client.transactions
        removed = self._keys.removed(write.url).encode()
        if write.record is not None:  # the removal's tombstone goes before the claim comes
            admin = self._keys.admin(write.url).encode()
            ops = [tx.delete(removed), tx.put(admin, encode(write.record))]
        else:  # the tombstone comes before the claims go: no replica re-learns between
            lease = await client.lease(self._tombstone_ttl)
            members = self._keys.members(write.url).encode()
            ops = [
                tx.put(removed, self.view.replica.encode(), lease=lease.id),
                tx.delete(members, range_end=prefix_range_end(members)),
            ]
        await client.transaction(compare=[], success=ops, failure=[])


async def _first_failure(*jobs: Any) -> None:
    """Run the session's loops until one of them ends (by failing); cancel the others."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # raises the failure
        raise ConnectionError("a session loop ended")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
