"""The workers' pure parts: the snapshot codec, the restart backoff, the --workers flag, and
how a worker applies the owner's snapshots to its own registry (``OwnerLink.apply``, with
no sockets: it is synchronous)."""

from __future__ import annotations

import dataclasses

import pytest

from pdproxy.cli.main import parse_config
from pdproxy.config.resilience import OutlierConfig
from pdproxy.config.workers import RunDir, WorkerSpec
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.membership.workers.link import OwnerLink
from pdproxy.membership.workers.snapshot import (
    EndpointRecord,
    Snapshot,
    decode_snapshot,
    encode_snapshot,
    pack,
    snapshot_of,
)
from pdproxy.proxying.leg_counts import forget_kv_sources
from pdproxy.resilience.outlier import OutlierDetector
from pdproxy.runtime.restart import RestartBackoff
from pdproxy.types import (
    Endpoint,
    EndpointState,
    EngineAddress,
    EngineLoad,
    ProbeState,
    RankLoad,
    Role,
    Source,
)

P = "http://10.0.0.1:8100"
D = "http://10.0.0.2:8200"


def _endpoint(url: str, role: Role = Role.DECODE, **fields) -> Endpoint:
    address = EngineAddress(url=url, zmq_address="10.0.0.9:5555", dp_size=2, transfer_mode="READ")
    last_seen = fields.pop("last_seen", None)
    endpoint = Endpoint.new(role=role, address=address, source=Source.REGISTERED, **fields)
    endpoint.presence.last_seen = last_seen
    return endpoint


def _record(url: str, role: Role = Role.DECODE, **fields) -> EndpointRecord:
    return EndpointRecord.of(_endpoint(url, role, **fields))


def test_a_snapshot_survives_the_wire():
    load = EngineLoad(3, 4, 0.5, 123.25, ranks=(RankLoad(0, 1, 2, 0.5), RankLoad(1, 2, 2, 0.25)))
    decode = _endpoint(D, models=("m",), engine_ids=("e0", "e1"), last_seen=99.5)
    decode.load.engine_load = load
    decode.health.probe, decode.health.probe_failures = ProbeState.UNHEALTHY, 3
    prefill = _endpoint(P, Role.PREFILL, state=EndpointState.PENDING)
    snapshot = snapshot_of(7, [prefill, decode])
    assert decode_snapshot(encode_snapshot(snapshot)) == snapshot
    assert snapshot.endpoints[1].load == load and snapshot.endpoints[1].probe_failures == 3


def test_a_snapshot_carries_the_owners_shared_registry_status_or_none():
    backend = {"backend": "etcd", "up": False, "endpoints": ["127.0.0.1:2379"], "revision": 9}
    backend |= {"sync_age_s": 1.5, "last_error": "unavailable", "pending_writes": 2}
    with_backend = snapshot_of(4, [_endpoint(D)], backend)
    assert decode_snapshot(encode_snapshot(with_backend)) == with_backend
    in_process = snapshot_of(5, [_endpoint(D)])
    raw = encode_snapshot(in_process)
    assert b"backend" not in raw  # an in-process owner sends no key at all
    assert decode_snapshot(raw).backend is None


@pytest.mark.parametrize("backend", [[1, 2], "etcd", 1, True])
def test_a_snapshot_whose_backend_is_not_a_map_is_a_value_error(backend):
    raw = pack({"seq": 1, "endpoints": [], "backend": backend})
    with pytest.raises(ValueError, match="backend must be a map"):
        decode_snapshot(raw)


def test_a_worker_shows_the_backend_of_the_snapshot_it_applied_last(follower):
    link = follower[0]
    assert link.backend_status() == {"backend": "in-process", "up": True}
    link.apply(Snapshot(1, (), {"backend": "etcd", "up": True}))
    link.apply(Snapshot(2, (), {"backend": "etcd", "up": False}))
    assert link.backend_status() == {"backend": "etcd", "up": False}
    link.apply(Snapshot(1, (), {"backend": "etcd", "up": True}))  # an old number: ignored
    assert link.backend_status()["up"] is False


@pytest.mark.parametrize("raw", [b"", b"\xc1", b"\x93\x01\x02\x03", b"\x81\xa3seq\x01"])
def test_a_garbled_snapshot_is_a_value_error(raw):
    with pytest.raises(ValueError):
        decode_snapshot(raw)


def test_restart_backoff_doubles_caps_and_forgives_a_worker_that_served():
    backoff = RestartBackoff(initial=0.5, maximum=4, stable_after=30)
    assert [backoff.delay(lived=1) for _ in range(6)] == [0.5, 1, 2, 4, 4, 4]
    assert backoff.delay(lived=31) == 0.5
    assert backoff.delay(lived=2) == 1


def test_workers_flag_defaults_to_one_and_is_bounded(capsys):
    base = ["--prefill", "a:1", "--decode", "b:2"]
    assert parse_config(base).workers == 1
    assert parse_config([*base, "--workers", "4"]).workers == 4
    assert parse_config(base, environ={"PDPROXY_WORKERS": "3"}).workers == 3
    for bad in ("0", "257"):
        with pytest.raises(SystemExit) as exc:
            parse_config([*base, "--workers", bad])
        assert exc.value.code == 2
    assert "--workers must be in 1-256" in capsys.readouterr().err


class _Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def follower():
    clock = _Clock()
    registry = EndpointRegistry(clock)
    outliers = OutlierDetector(OutlierConfig(consecutive_failures=1), clock)
    outliers.on_connections_lost(forget_kv_sources)  # as pdproxy.build wires the book
    spec = WorkerSpec(0, 2, 8000, RunDir("/nonexistent"), parent_pid=1)
    link = OwnerLink(spec, registry=registry, outliers=outliers, max_age=3.0, admin_timeout=1)
    yield link, registry, outliers, clock
    await link.aclose()


def test_apply_admits_updates_in_place_and_keeps_the_workers_own_figures(follower):
    link, registry, _, _ = follower
    link.apply(Snapshot(1, (_record(P, Role.PREFILL), _record(D))))
    decode = registry.get(D)
    assert decode is not None and decode.presence.expires_at is None  # only the owner expires
    assert registry.snapshot().decode == (decode,)
    decode.legs.in_flight, decode.health.consecutive_failures = 2, 1
    load = EngineLoad(running=5, waiting=1, kv_usage=0.1, scraped_at=999.0)
    link.apply(Snapshot(2, (_record(P, Role.PREFILL), _record(D, models=("m",)))))
    assert registry.get(D) is decode and decode.models == ("m",)
    record = dataclasses.replace(_record(D), load=load, probe=ProbeState.UNHEALTHY)
    link.apply(Snapshot(3, (_record(P, Role.PREFILL), record)))
    assert registry.get(D) is decode and decode.legs.in_flight == 2
    assert decode.health.consecutive_failures == 1  # passive health is the worker's
    assert decode.health.probe is ProbeState.UNHEALTHY and registry.snapshot().decode == ()
    # The engine's figures count this worker's 2 legs, which the scheduler adds live.
    assert decode.load.engine_load is not None and decode.load.engine_load.own == 2
    assert (decode.load.others, decode.load.others_until) == (4, 1002.0)
    link.apply(Snapshot(2, (_record(P, Role.PREFILL),)))  # an old number: ignored
    assert registry.get(D) is decode and link.seq == 3


def test_an_instance_the_owner_dropped_drains_here_until_its_last_leg(follower):
    link, registry, _, _ = follower
    link.apply(Snapshot(1, (_record(P, Role.PREFILL), _record(D))))
    decode = registry.get(D)
    assert decode is not None
    decode.legs.in_flight = 1
    link.apply(Snapshot(2, (_record(P, Role.PREFILL),)))
    assert registry.get(D) is decode and decode.state is EndpointState.DRAINING
    assert registry.snapshot().decode == ()
    decode.legs.in_flight = 0
    link.apply(Snapshot(3, (_record(P, Role.PREFILL),)))
    assert registry.get(D) is None
    link.apply(Snapshot(4, ()))  # no legs on it: gone at once
    assert len(registry) == 0


def test_a_changed_address_replaces_the_instance(follower):
    link, registry, _, _ = follower
    link.apply(Snapshot(1, (_record(D),)))
    before = registry.get(D)
    moved = dataclasses.replace(
        _record(D), address=EngineAddress(url=D, zmq_address="10.0.0.9:6666")
    )
    link.apply(Snapshot(2, (moved,)))
    after = registry.get(D)
    assert after is not before and after is not None
    assert after.address.zmq_address == "10.0.0.9:6666"


def test_the_owners_probes_replay_their_effect_on_this_workers_ejections(follower):
    link, registry, outliers, clock = follower
    link.apply(Snapshot(1, (_record(P, Role.PREFILL), _record(D))))
    decode = registry.get(D)
    prefill = registry.get(P)
    assert decode is not None and prefill is not None
    assert outliers.on_failure(decode, [decode, prefill])  # ejected by this worker's legs
    assert decode.health.ejected_until == clock.now + 5
    failing = dataclasses.replace(_record(D), probe_failures=1)
    link.apply(Snapshot(2, (_record(P, Role.PREFILL), failing)))
    assert decode.health.probe_failed_while_ejected
    decode.legs.kv_sources["old-engine"] = None
    link.apply(Snapshot(3, (_record(P, Role.PREFILL), _record(D))))  # answers again: restarted
    # Its trial is let through now rather than after the ejection.
    assert decode.health.ejected_until == clock.now and not decode.legs.kv_sources
    # Back from unhealthy: a clean record, as in a single process.
    decode.health.consecutive_failures = 2
    down = dataclasses.replace(_record(D), probe=ProbeState.UNHEALTHY)
    link.apply(Snapshot(4, (_record(P, Role.PREFILL), down)))
    link.apply(Snapshot(5, (_record(P, Role.PREFILL), _record(D))))
    assert decode.health.probe is ProbeState.HEALTHY and decode.health.consecutive_failures == 0


def test_the_owner_knows_the_resolved_port_and_every_process_the_hop(tmp_path):
    """Issue 19: the membership owner serves no HTTP, yet refuses pdproxy's own address as
    an instance; with ``--port 0`` only the supervisor knows which port that is."""
    from pdproxy.runtime.supervisor import _Supervisor

    argv = ["--prefill", "a:1", "--decode", "c:3", "--port", "0", "--workers", "2"]
    config = parse_config(argv, {})
    supervisor = _Supervisor(config, RunDir(str(tmp_path)), 43210)
    assert supervisor._config.port == 43210
    assert supervisor._config.hop_id == config.hop_id  # pickled to every worker as it is
