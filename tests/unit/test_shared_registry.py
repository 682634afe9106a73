"""The shared registry's pure parts: key layout, values, the fold of a URL's entries, the
decision table, and ``ReplicaView`` on a real Membership without etcd (no echo)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pdproxy.app import create_app
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.registry import RegistryConfig, SharedRegistryConfig, parse_registry_backend
from pdproxy.config.resilience import HealthConfig
from pdproxy.errors import ConfigError
from pdproxy.membership.discovery.replica import ReplicaView
from pdproxy.membership.discovery.shared import (
    Action,
    Entry,
    Key,
    Keys,
    Kind,
    Learned,
    Local,
    Record,
    Shared,
    decide,
    decode,
    encode,
    lease_ttl,
    shared_view,
    tombstone_ttl,
)
from pdproxy.types import EndpointState, EngineAddress, Role, Source

URL = "http://10.0.0.7:8100"
KEYS = Keys("/pdproxy/fleet-a/")
ADDRESS = EngineAddress(url=URL, zmq_address="10.0.0.7:14579", dp_size=2, transfer_mode="READ")


def _record(source=Source.REGISTERED, replica="a", url=URL, role=Role.DECODE) -> Record:
    return Record(role, EngineAddress(url=url), source, replica)


# -- keys and values ----------------------------------------------------------------------


def test_keys_are_one_segment_per_url_and_parse_back():
    assert KEYS.admin(URL) == "/pdproxy/fleet-a/members/http%3A%2F%2F10.0.0.7%3A8100/admin"
    assert KEYS.seen(URL, "pod-1") == (
        "/pdproxy/fleet-a/members/http%3A%2F%2F10.0.0.7%3A8100/seen-by/pod-1"
    )
    assert KEYS.removed(URL) == "/pdproxy/fleet-a/removed/http%3A%2F%2F10.0.0.7%3A8100"
    assert KEYS.parse(KEYS.admin(URL)) == Key(Kind.ADMIN, URL)
    assert KEYS.parse(KEYS.seen(URL, "pod/1")) == Key(Kind.SEEN, URL, "pod/1")
    assert KEYS.parse(KEYS.removed(URL)) == Key(Kind.REMOVED, URL)
    assert KEYS.seen(URL, "x").startswith(KEYS.members(URL))


@pytest.mark.parametrize(
    "key",
    [
        "/pdproxy/fleet-b/members/http%3A%2F%2Fh%3A1/admin",  # another fleet's prefix
        "/pdproxy/fleet-a/other/http%3A%2F%2Fh%3A1",
        "/pdproxy/fleet-a/members/not-a-url/admin",
        "/pdproxy/fleet-a/members/http%3A%2F%2Fh%3A1/owner",
        "/pdproxy/fleet-a/members/http%3A%2F%2Fh%3A1/seen-by/",
        "/pdproxy/fleet-a/members/http%3A%2F%2Fh%3A1/seen-by/a/b",
        "/pdproxy/fleet-a/removed/http%3A%2F%2Fh%3A1/extra",
    ],
)
def test_foreign_or_malformed_keys_are_not_ours(key):
    assert KEYS.parse(key) is None


def test_a_record_round_trips_and_is_compact_json():
    record = Record(Role.PREFILL, ADDRESS, Source.REGISTERED, "pod-1")
    raw = encode(record)
    assert decode(raw) == record
    assert json.loads(raw)["v"] == 1 and b" " not in raw


def test_the_kv_events_endpoints_survive_the_round_trip_and_old_records_still_read():
    """Every replica follows the same publishers; a record written before the fields
    existed (or by an instance that named none) reads as one without them."""
    address = dataclasses.replace(
        ADDRESS,
        kv_events_endpoint="tcp://{host}:5557",
        kv_events_replay_endpoint="ipc:///run/vllm/{port}_{dp_rank}.replay",
    )
    record = Record(Role.DECODE, address, Source.ADMIN, "pod-2")
    value = json.loads(encode(record))
    assert value["kv_events_endpoint"] == "tcp://{host}:5557"
    assert decode(encode(record)) == record
    old = json.loads(encode(_record()))
    assert not set(old) & {"kv_events_endpoint", "kv_events_replay_endpoint"}
    assert decode(json.dumps(old).encode()).address.kv_events_endpoint is None
    old["kv_events_endpoint"] = None  # written as null by another writer: the same
    assert decode(json.dumps(old).encode()) == _record()


@pytest.mark.parametrize(
    "change",
    [
        {"v": 2},
        {"kv_events_endpoint": "http://h:5557"},
        {"kv_events_replay_endpoint": 5558},
        {"kv_events_endpoint": "tcp://{hostname}:5557"},
        {"source": "static"},
        {"role": "both"},
        {"url": "ftp://h:1"},
        {"dp_size": 0},
        {"dp_size": True},
        {"replica": 7},
        {"zmq_address": 5},
    ],
)
def test_values_this_version_did_not_write_are_refused(change):
    value = json.loads(encode(_record()))
    value.update(change)
    with pytest.raises(ValueError):
        decode(json.dumps(value).encode())


def test_garbage_and_oversized_values_are_refused():
    for raw in (b"[]", b"\xff", b"x" * 20_000):
        with pytest.raises(ValueError):
            decode(raw)


def test_leases_are_whole_seconds_with_a_floor_and_tombstones_outlive_partitions():
    assert lease_ttl(0.6) == 2 and lease_ttl(5.0) == 5 and lease_ttl(5.5) == 6
    assert tombstone_ttl(2.0) == 60 and tombstone_ttl(30.0) == 300


def test_registry_backend_flag():
    assert parse_registry_backend(None) == () == parse_registry_backend("in-process")
    assert parse_registry_backend("etcd://10.0.0.1:2379,etcd-1.etcd:2379") == (
        ("10.0.0.1", 2379),
        ("etcd-1.etcd", 2379),
    )
    for bad in ("etcd://", "redis://h:1", "etcd://h", "h:2379"):
        with pytest.raises(ConfigError):
            parse_registry_backend(bad)
    with pytest.raises(ConfigError):
        SharedRegistryConfig(etcd=(("h", 1),), prefix="pdproxy/")
    # A replica with neither engines nor a ZMQ registry is fine when it shares one.
    ProxyConfig(registry=RegistryConfig(shared=SharedRegistryConfig(etcd=(("h", 1),))))
    with pytest.raises(ConfigError):
        ProxyConfig()


# -- the fold and the decision --------------------------------------------------------------


def test_the_view_follows_admin_first_then_the_latest_and_never_its_own_claim():
    mine, theirs, admin = _record(replica="me"), _record(replica="b"), _record(Source.ADMIN)
    entries = {
        Key(Kind.SEEN, URL, "me"): Entry(mine, 9),
        Key(Kind.SEEN, URL, "b"): Entry(theirs, 5),
    }
    assert shared_view(entries, "me") == Shared(theirs, 5, False)
    assert shared_view({Key(Kind.SEEN, URL, "me"): Entry(mine, 9)}, "me") == Shared(None, 0, False)
    entries[Key(Kind.ADMIN, URL)] = Entry(admin, 3)
    assert shared_view(entries, "me").record is admin
    entries[Key(Kind.REMOVED, URL)] = Entry(None, 10)
    assert shared_view(entries, "me").removed
    unreadable = {Key(Kind.SEEN, URL, "b"): Entry(None, 4)}
    assert shared_view(unreadable, "me").record is None


@pytest.mark.parametrize(
    ("shared", "local", "learned", "action"),
    [
        # a claim from another replica: admitted once per write
        (Shared(_record(), 5, False), Local.ABSENT, None, Action.LEARN),
        (Shared(_record(), 5, False), Local.ABSENT, Learned(_record(), 5), Action.NOTHING),
        (Shared(_record(), 6, False), Local.ABSENT, Learned(_record(), 5), Action.LEARN),
        (Shared(_record(), 6, False), Local.LEARNED, Learned(_record(), 5), Action.NOTHING),
        (
            Shared(_record(role=Role.PREFILL), 6, False),
            Local.LEARNED,
            Learned(_record(), 5),
            Action.LEARN,
        ),
        (Shared(_record(), 5, False), Local.OWN, None, Action.NOTHING),
        (Shared(_record(), 5, False), Local.DRAINING, None, Action.NOTHING),
        # no claim left: only what was learned is forgotten
        (Shared(None, 0, False), Local.LEARNED, Learned(_record(), 5), Action.FORGET),
        (Shared(None, 0, False), Local.OWN, None, Action.NOTHING),
        (Shared(None, 0, False), Local.ABSENT, None, Action.NOTHING),
        # a removal: applied to whatever is here and not draining yet
        (Shared(None, 0, True), Local.OWN, None, Action.DRAIN),
        (Shared(_record(), 5, True), Local.LEARNED, Learned(_record(), 5), Action.DRAIN),
        (Shared(None, 0, True), Local.DRAINING, None, Action.NOTHING),
        (Shared(_record(), 5, True), Local.ABSENT, None, Action.NOTHING),
    ],
)
def test_decisions(shared, local, learned, action):
    assert decide(shared, local, learned) is action


# -- ReplicaView on a real Membership, no etcd ---------------------------------------------


@pytest.fixture
async def view():
    static = (EngineAddress(url="http://127.0.0.1:9"),)  # never probed: checks are off
    config = ProxyConfig(prefill=static, decode=static, health=HealthConfig(interval=0))
    state = create_app(config).state.pdproxy
    yield ReplicaView("me", KEYS, state.membership, state.registry), state
    await state.health.aclose()
    await state.membership.aclose()


async def test_what_is_learned_from_others_is_not_written_back(view):
    replica, state = view
    replica.put(KEYS.seen(URL, "b"), Entry(_record(replica="b"), 5))
    endpoint = state.registry.get(URL)
    assert endpoint is not None and endpoint.presence.expires_at is None
    assert endpoint.source is Source.REGISTERED
    assert not replica.own and not replica.dirty and not replica.outbox
    replica.delete(KEYS.seen(URL, "b"))
    assert state.registry.get(URL) is None  # no claim left: forgotten


async def test_own_claims_come_from_heartbeats_and_go_with_their_expiry(view):
    from pdproxy.types import Registration

    replica, state = view
    registration = Registration(role=Role.DECODE, address=EngineAddress(url=URL), format="p2p")
    assert state.membership.heartbeat(registration) == "accepted"
    assert replica.own[URL].replica == "me" and replica.dirty == {URL}
    replica.dirty.clear()
    state.membership.heartbeat(registration)
    assert not replica.dirty  # the steady state writes nothing
    # Its own claim, seen in the store, is never a reason to act; deleted by anything but
    # this replica (its lease lost), it is written again.
    replica.put(KEYS.seen(URL, "me"), Entry(replica.own[URL], 7))
    assert state.registry.get(URL).presence.expires_at is not None and not replica.dirty
    replica.delete(KEYS.seen(URL, "me"))
    assert replica.dirty == {URL} and state.registry.get(URL) is not None
    replica.dirty.clear()
    replica.expired(URL)
    assert URL not in replica.own and replica.dirty == {URL}


async def test_a_removal_elsewhere_drains_here_without_an_echo(view):
    replica, state = view
    replica.put(KEYS.admin(URL), Entry(_record(Source.ADMIN, replica="b"), 3))
    assert state.registry.get(URL).source is Source.ADMIN
    state.registry.get(URL).legs.in_flight = 1  # so the drain is visible before it completes
    replica.put(KEYS.removed(URL), Entry(None, 4))
    assert state.registry.get(URL).state is EndpointState.DRAINING
    assert not replica.outbox  # applied, not re-published
    # A full read that no longer shows it changes nothing more; an admin drain here is
    # published as one removal.
    replica.replace_all({})
    state.registry.get(URL).legs.in_flight = 0
    replica.drained("http://10.0.0.8:8100")
    assert [w.record for w in replica.outbox] == [None]


def test_the_flags_reach_the_config_and_a_missing_client_is_a_clear_error(monkeypatch):
    from pdproxy.cli import main as cli
    from pdproxy.membership.discovery import shared

    argv = ["--registry-backend", "etcd://127.0.0.1:2379,[::1]:2380", "--etcd-prefix", "/f/"]
    config = cli.parse_config(argv, environ={})
    assert config.registry.shared == SharedRegistryConfig(
        etcd=(("127.0.0.1", 2379), ("::1", 2380)), prefix="/f/"
    )
    assert config.registry.port is None and not config.prefill
    env = {"PDPROXY_REGISTRY_BACKEND": "etcd://10.1.2.3:2379"}
    assert cli.parse_config([], environ=env).registry.shared.etcd == (("10.1.2.3", 2379),)
    assert not cli.parse_config(
        ["--prefill", "h:1", "--decode", "h:2"], environ={}
    ).registry.shared.enabled

    monkeypatch.setattr(shared.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"pdproxy\[etcd\]"):
        shared.require_etcd()
    with pytest.raises(SystemExit):
        cli.parse_config(argv, environ={})


@pytest.mark.parametrize(
    ("field", "bad"),
    [
        ("zmq_address", "10.0.0.7:21001\r\nX-Injected: 1"),
        ("zmq_address", "10.0.0.7:2100\u20ac"),
        ("url", "http://\u00e4\u20ac:8100"),
        ("url", "http://0.0.0.0:8100"),
        ("url", "http://10.0.0.7:\u0668\u0660"),
    ],
)
def test_a_record_that_would_go_unsendable_into_a_header_is_refused(field, bad):
    """Issue 19: another replica's record is checked as a registration is."""
    value = json.loads(encode(_record()))
    value[field] = bad
    with pytest.raises(ValueError):
        decode(json.dumps(value).encode())
