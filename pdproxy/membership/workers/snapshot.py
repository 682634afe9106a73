"""The wire format between the membership owner and its workers (msgpack, pure).

A snapshot is the owner's whole membership at one moment, numbered: every instance with what
the owner alone learns about it (its address and source, its admission state, the active
health verdict and the run of failed probes, the engine's last load figures, the models and
engine ids its probes found). What each worker learns for itself (in-flight legs, passive
health, measured speed) is never on the wire. The control requests a worker sends to the
owner (a snapshot, an admin addition or removal) and their answers use the same codec.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack

from pdproxy.types import (
    Endpoint,
    EndpointHealth,
    EndpointIdentity,
    EndpointState,
    EngineAddress,
    EngineLoad,
    Presence,
    ProbeState,
    RankLoad,
    Role,
    Source,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointRecord:
    """One instance as the owner knows it."""

    role: Role
    address: EngineAddress
    source: Source
    state: EndpointState
    probe: ProbeState
    probe_failures: int  # consecutive, as the owner's health checks count them
    last_seen: float | None = None
    models: tuple[str, ...] = ()
    engine_ids: tuple[str, ...] = ()
    load: EngineLoad | None = None  # scraped_at is CLOCK_MONOTONIC, the same in every process

    @classmethod
    def of(cls, endpoint: Endpoint) -> EndpointRecord:
        return cls(
            role=endpoint.role,
            address=endpoint.address,
            source=endpoint.source,
            state=endpoint.state,
            probe=endpoint.health.probe,
            probe_failures=endpoint.health.probe_failures,
            last_seen=endpoint.presence.last_seen,
            models=endpoint.models,
            engine_ids=endpoint.engine_ids,
            load=endpoint.load.engine_load,
        )

    def endpoint(self) -> Endpoint:
        """A new worker-side ``Endpoint`` (no lease: only the owner expires instances)."""
        identity = EndpointIdentity(
            role=self.role,
            address=self.address,
            source=self.source,
            models=self.models,
            engine_ids=self.engine_ids,
        )
        return Endpoint(
            identity=identity,
            presence=Presence(state=self.state, last_seen=self.last_seen),
            health=EndpointHealth(probe=self.probe),
        )


@dataclass(frozen=True, slots=True)
class Snapshot:
    seq: int
    endpoints: tuple[EndpointRecord, ...]
    # --registry-backend etcd://: the owner's shared-registry status for /status; None
    # in-process
    backend: dict[str, Any] | None = None


def snapshot_of(
    seq: int, endpoints: Iterable[Endpoint], backend: dict[str, Any] | None = None
) -> Snapshot:
    return Snapshot(seq, tuple(EndpointRecord.of(e) for e in endpoints), backend)


# -- encoding ------------------------------------------------------------------------------


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(raw: bytes) -> dict[str, Any]:
    """A message dict; ``ValueError`` when ``raw`` is not one."""
    try:
        message = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise ValueError(f"undecodable message: {exc}") from exc
    if not isinstance(message, dict):
        raise ValueError("a message must be a map")
    return message


def encode_snapshot(snapshot: Snapshot) -> bytes:
    message: dict[str, Any] = {
        "seq": snapshot.seq,
        "endpoints": [record_dict(r) for r in snapshot.endpoints],
    }
    if snapshot.backend is not None:
        message["backend"] = snapshot.backend
    return pack(message)


def decode_snapshot(raw: bytes) -> Snapshot:
    message = unpack(raw)
    try:
        backend = message.get("backend")
        if backend is not None and not isinstance(backend, dict):
            raise ValueError("a snapshot's backend must be a map")
        return Snapshot(
            int(message["seq"]), tuple(record_from(d) for d in message["endpoints"]), backend
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed snapshot: {exc!r}") from exc


def address_dict(address: EngineAddress) -> dict[str, Any]:
    return {
        "url": address.url,
        "zmq_address": address.zmq_address,
        "dp_size": address.dp_size,
        "tp_size": address.tp_size,
        "transfer_mode": address.transfer_mode,
        "bootstrap_url": address.bootstrap_url,
        "kv_events_endpoint": address.kv_events_endpoint,
        "kv_events_replay_endpoint": address.kv_events_replay_endpoint,
    }


def address_from(d: dict[str, Any]) -> EngineAddress:
    return EngineAddress(
        url=str(d["url"]),
        zmq_address=d.get("zmq_address"),
        dp_size=int(d.get("dp_size", 1)),
        tp_size=int(d.get("tp_size", 1)),
        transfer_mode=d.get("transfer_mode"),
        bootstrap_url=d.get("bootstrap_url"),
        kv_events_endpoint=d.get("kv_events_endpoint"),
        kv_events_replay_endpoint=d.get("kv_events_replay_endpoint"),
    )


def record_dict(record: EndpointRecord) -> dict[str, Any]:
    return {
        "role": record.role.value,
        "address": address_dict(record.address),
        "source": record.source.value,
        "state": record.state.value,
        "probe": record.probe.value,
        "probe_failures": record.probe_failures,
        "last_seen": record.last_seen,
        "models": list(record.models),
        "engine_ids": list(record.engine_ids),
        "load": None if record.load is None else _load_dict(record.load),
    }


def record_from(d: dict[str, Any]) -> EndpointRecord:
    load = d.get("load")
    return EndpointRecord(
        role=Role(d["role"]),
        address=address_from(d["address"]),
        source=Source(d["source"]),
        state=EndpointState(d["state"]),
        probe=ProbeState(d["probe"]),
        probe_failures=int(d["probe_failures"]),
        last_seen=None if d.get("last_seen") is None else float(d["last_seen"]),
        models=tuple(str(m) for m in d.get("models", ())),
        engine_ids=tuple(str(i) for i in d.get("engine_ids", ())),
        load=None if load is None else _load_from(load),
    )


def _load_dict(load: EngineLoad) -> dict[str, Any]:
    return {
        "running": load.running,
        "waiting": load.waiting,
        "kv_usage": load.kv_usage,
        "scraped_at": load.scraped_at,
        "ranks": [[r.rank, r.running, r.waiting, r.kv_usage] for r in load.ranks],
    }


def _load_from(d: dict[str, Any]) -> EngineLoad:
    return EngineLoad(
        running=float(d["running"]),
        waiting=float(d["waiting"]),
        kv_usage=float(d["kv_usage"]),
        scraped_at=float(d["scraped_at"]),
        ranks=tuple(RankLoad(int(r[0]), float(r[1]), float(r[2]), float(r[3])) for r in d["ranks"]),
    )
