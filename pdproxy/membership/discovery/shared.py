"""The shared registry's data, apart from any etcd I/O: key layout, values, and what a
replica does about one instance when the shared view of it changes.

Keys, under ``--etcd-prefix`` (``/pdproxy/default/``), with the instance's URL
percent-encoded so it is one path segment::

    <prefix>members/<url>/admin               added through an admin API; no lease
    <prefix>members/<url>/seen-by/<replica>   <replica> hears its heartbeats; that
                                              replica's lease
    <prefix>removed/<url>                     removed through an admin API; a lease of
                                              ``tombstone_ttl``

A value is a small JSON object (``Record``): the role and the address the engine announced
(with where its KV events are, when it said so), the source, and the replica that wrote
it. An instance is in the shared registry while it has a claim under ``members/<url>/`` and
no ``removed/<url>`` tombstone.
"""

from __future__ import annotations

import enum
import importlib.util
import json
import math
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

from pdproxy.config.addresses import kv_address_problem, parse_engine_url
from pdproxy.config.scheduling import events_endpoint
from pdproxy.errors import ConfigError
from pdproxy.types import EngineAddress, Role, Source

VERSION = 1
ADMIN = "admin"
_SEEN_BY = "seen-by"
_MEMBERS = "members/"
_REMOVED = "removed/"
_MAX_VALUE = 16 * 1024
_MISSING = "--registry-backend etcd:// needs the etcd extra: pip install 'pdproxy[etcd]' (aetcd)"
_EVENTS_FIELDS = ("kv_events_endpoint", "kv_events_replay_endpoint")  # optional in a value


def require_etcd() -> None:
    """Raise ``ConfigError`` unless the ``etcd`` extra is installed (without importing it)."""
    if importlib.util.find_spec("aetcd") is None:
        raise ConfigError(_MISSING)


def tombstone_ttl(registry_ttl: float) -> int:
    """How long a removal is remembered: long past a replica's partition from etcd, so one
    that comes back sees it rather than re-announcing the instance, yet not forever."""
    return max(60, math.ceil(10 * registry_ttl))


def lease_ttl(registry_ttl: float) -> int:
    """A replica's lease: its heartbeat-learned claims vanish one registry TTL after the
    replica stops keeping it alive (etcd counts whole seconds, at least 2)."""
    return max(2, math.ceil(registry_ttl))


class Kind(str, enum.Enum):
    ADMIN = "admin"  # members/<url>/admin
    SEEN = "seen"  # members/<url>/seen-by/<replica>
    REMOVED = "removed"  # removed/<url>


@dataclass(frozen=True, slots=True)
class Key:
    """A parsed key: which instance, what kind of entry, and for a claim whose."""

    kind: Kind
    url: str
    replica: str = ""


class Keys:
    """The key layout under one prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def admin(self, url: str) -> str:
        return f"{self.members(url)}{ADMIN}"

    def seen(self, url: str, replica: str) -> str:
        return f"{self.members(url)}{_SEEN_BY}/{quote(replica, safe='')}"

    def members(self, url: str) -> str:
        """The prefix of every claim on ``url``."""
        return f"{self.prefix}{_MEMBERS}{quote(url, safe='')}/"

    def removed(self, url: str) -> str:
        return f"{self.prefix}{_REMOVED}{quote(url, safe='')}"

    def parse(self, key: str) -> Key | None:
        """The entry ``key`` names, or None for a key that is not one of ours."""
        if not key.startswith(self.prefix):
            return None
        rest = key[len(self.prefix) :]
        if rest.startswith(_REMOVED):
            tail = rest[len(_REMOVED) :]
            url = unquote(tail)
            return Key(Kind.REMOVED, url) if _is_url(url) and "/" not in tail else None
        if not rest.startswith(_MEMBERS):
            return None
        parts = rest[len(_MEMBERS) :].split("/")
        url = unquote(parts[0])
        if not _is_url(url):
            return None
        if parts[1:] == [ADMIN]:
            return Key(Kind.ADMIN, url)
        if len(parts) == 3 and parts[1] == _SEEN_BY and parts[2]:
            return Key(Kind.SEEN, url, unquote(parts[2]))
        return None


def _is_url(url: str) -> bool:
    """``scheme://host:port`` as every address source checks it (it becomes a Host header)."""
    try:
        parse_engine_url(url)
    except ConfigError:
        return False
    return url.startswith(("http://", "https://"))


@dataclass(frozen=True, slots=True)
class Record:
    """What a claim says of an instance: enough to admit it as its own source would."""

    role: Role
    address: EngineAddress
    source: Source  # REGISTERED (heartbeats) or ADMIN
    replica: str  # who wrote it

    @property
    def url(self) -> str:
        return self.address.url

    def same_instance(self, role: Role, address: EngineAddress, source: Source) -> bool:
        return (self.role, self.address, self.source) == (role, address, source)


def encode(record: Record) -> bytes:
    a = record.address
    value = {
        "v": VERSION,
        "role": record.role.value,
        "source": record.source.value,
        "replica": record.replica,
        "url": a.url,
        "zmq_address": a.zmq_address,
        "dp_size": a.dp_size,
        "tp_size": a.tp_size,
        "transfer_mode": a.transfer_mode,
        "bootstrap_url": a.bootstrap_url,
    }
    # Where its KV events are, when it said so: every replica follows the same publishers.
    # Absent otherwise, so a record reads (and is written) as before these fields existed.
    for name in _EVENTS_FIELDS:
        if (endpoint := getattr(a, name)) is not None:
            value[name] = endpoint
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def decode(raw: bytes) -> Record:
    """A claim's value; ``ValueError`` for anything this version did not write."""
    if len(raw) > _MAX_VALUE:
        raise ValueError(f"value of {len(raw)} bytes")
    value = json.loads(raw)
    if not isinstance(value, dict) or value.get("v") != VERSION:
        raise ValueError("not a version-1 record")
    source = Source(_field(value, "source", str))
    if source not in (Source.REGISTERED, Source.ADMIN):
        raise ValueError(f"source {source.value} is not shared")
    url = _field(value, "url", str)
    if not _is_url(url):
        raise ValueError(f"url {url!r}")
    address = EngineAddress(
        url=url,
        zmq_address=_kv_address(value),
        dp_size=_size(value, "dp_size"),
        tp_size=_size(value, "tp_size"),
        transfer_mode=_optional(value, "transfer_mode"),
        bootstrap_url=_optional(value, "bootstrap_url"),
        kv_events_endpoint=_events(value, "kv_events_endpoint"),
        kv_events_replay_endpoint=_events(value, "kv_events_replay_endpoint"),
    )
    return Record(Role(_field(value, "role", str)), address, source, _field(value, "replica", str))


def _field(value: dict[str, Any], name: str, kind: type) -> Any:
    item = value.get(name)
    if not isinstance(item, kind) or isinstance(item, bool):
        raise ValueError(f"{name} must be a {kind.__name__}")
    return item


def _optional(value: dict[str, Any], name: str) -> str | None:
    return None if value.get(name) is None else _field(value, name, str)


def _kv_address(value: dict[str, Any]) -> str | None:
    """As the ZMQ registry checks it (it goes into request ids and headers)."""
    text = _optional(value, "zmq_address")
    if text is not None and kv_address_problem(text) is not None:
        raise ValueError("zmq_address is not a KV address")
    return text


def _events(value: dict[str, Any], name: str) -> str | None:
    """As a registration's (tcp:// or ipc://, a template of {host}, {port}, {dp_rank});
    a record written before the field existed has none."""
    try:
        return events_endpoint(value.get(name), name)
    except ConfigError as exc:
        raise ValueError(str(exc)) from exc


def _size(value: dict[str, Any], name: str) -> int:
    size: int = _field(value, name, int)
    if not 1 <= size <= 4096:
        raise ValueError(f"{name} {size} outside 1-4096")
    return size


@dataclass(frozen=True, slots=True)
class Entry:
    """One key's value as the watch last delivered it (``record`` None for a tombstone or a
    value this version cannot read) and the revision it was written at."""

    record: Record | None
    revision: int


@dataclass(frozen=True, slots=True)
class Shared:
    """The shared view of one instance, as far as this replica should act on it: the claim
    to follow and its revision (others' only: a replica's own claims mirror its local state
    and are never a reason to act), and whether a removal is recorded."""

    record: Record | None
    revision: int
    removed: bool


def shared_view(entries: dict[Key, Entry], replica: str) -> Shared:
    """Fold the entries on one instance into one view: an admin claim wins (as an
    admin-added instance wins over heartbeats locally), else the most recently written."""
    removed = False
    best: tuple[int, int, Record] | None = None  # (admin?, revision, record)
    for key, entry in entries.items():
        if key.kind is Kind.REMOVED:
            removed = True
        elif entry.record is not None and not (key.kind is Kind.SEEN and key.replica == replica):
            rank = (int(key.kind is Kind.ADMIN), entry.revision, entry.record)
            if best is None or rank[:2] > best[:2]:
                best = rank
    if best is None:
        return Shared(None, 0, removed)
    return Shared(best[2], best[1], removed)


class Local(str, enum.Enum):
    """What this replica holds at an instance's URL."""

    ABSENT = "absent"
    LEARNED = "learned"  # admitted from the shared registry, not heard locally since
    OWN = "own"  # from this replica's own sources (heartbeats, admin API, command line)
    DRAINING = "draining"  # any source, draining


class Action(str, enum.Enum):
    NOTHING = "nothing"
    LEARN = "learn"  # admit (or replace) it from the shared record
    DRAIN = "drain"  # a removal from another replica: drain it here too
    FORGET = "forget"  # no claim is left: drop what was learned


@dataclass(frozen=True, slots=True)
class Learned:
    """The claim this replica last admitted an instance from."""

    record: Record
    revision: int


def decide(shared: Shared, local: Local, learned: Learned | None) -> Action:
    """What to do with one instance, from its shared view, what this replica holds, and
    the claim it last admitted it from (None: never, or forgotten since).

    An instance that left this registry while its claim stayed the same (refused by its
    probe, say) is not admitted again from that same claim: only a newer write brings it
    back, so a refusal cannot turn into a loop of probes."""
    record = shared.record
    if shared.removed:
        return Action.DRAIN if local in (Local.LEARNED, Local.OWN) else Action.NOTHING
    if record is None:
        return Action.FORGET if local is Local.LEARNED else Action.NOTHING
    if local is Local.ABSENT:
        fresh = learned is None or learned.revision != shared.revision
        return Action.LEARN if fresh else Action.NOTHING
    if local is Local.LEARNED:
        same = learned is not None and learned.record.same_instance(
            record.role, record.address, record.source
        )
        return Action.NOTHING if same else Action.LEARN
    return Action.NOTHING
