"""Where instances come from besides the command line: the ZMQ registration socket, and the
registry replicas share (``--registry-backend``)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from pdproxy.config.addresses import parse_host_port
from pdproxy.errors import ConfigError
from pdproxy.types import EngineAddress


@dataclass(frozen=True, slots=True, kw_only=True)
class SharedRegistryConfig:
    """``--registry-backend``: where replicas share their registry. No ``etcd`` endpoints
    (the default) keeps it in-process, as a single replica's own."""

    etcd: tuple[tuple[str, int], ...] = ()  # (host, port) of each etcd member, tried in turn
    prefix: str = "/pdproxy/default/"  # --etcd-prefix: every key lives under it

    def __post_init__(self) -> None:
        if not self.prefix.startswith("/") or not self.prefix.endswith("/") or "//" in self.prefix:
            raise ConfigError("--etcd-prefix must be an absolute path ending in '/'")

    @property
    def enabled(self) -> bool:
        return bool(self.etcd)


def parse_registry_backend(text: str | None) -> tuple[tuple[str, int], ...]:
    """``--registry-backend``: ``in-process`` (or nothing), or
    ``etcd://host:port[,host:port...]``; returns the etcd endpoints, () for in-process."""
    if text is None or text.strip() in ("", "in-process"):
        return ()
    scheme, sep, rest = text.strip().partition("://")
    if not sep or scheme != "etcd" or not rest:
        raise ConfigError(
            f"--registry-backend {text!r}: use in-process or etcd://host:port[,host:port...]"
        )
    return tuple(parse_host_port(part.strip()) for part in rest.rstrip("/").split(","))


@dataclass(frozen=True, slots=True, kw_only=True)
class RegistryConfig:
    """The ZMQ registration socket; ``port=None`` keeps it off."""

    port: int | None = None
    host: str = "0.0.0.0"
    ttl: float = 5.0
    sweep_interval: float = 1.0
    max_message_bytes: int = 64 * 1024
    allow_cidrs: tuple[str, ...] = ()  # networks heartbeats may come from; () = any
    shared: SharedRegistryConfig = field(default_factory=SharedRegistryConfig)
    # a registration's bounds: its data- and tensor-parallel sizes (each DP rank gets a KV
    # event subscriber), and the hosts its own KV events endpoint may name besides its own
    max_dp_size: int = 256
    max_tp_size: int = 256
    kv_events_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.port is not None and not 1 <= self.port <= 65535:
            raise ConfigError("registry port must be in 1-65535")
        if not 256 <= self.max_message_bytes <= 16 * 1024 * 1024:
            raise ConfigError("--registry-max-message-bytes must be in 256 B - 16 MiB")
        for cidr in self.allow_cidrs:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError as exc:
                raise ConfigError(f"--registry-allow-cidr {cidr!r} is not a CIDR") from exc
        if self.ttl <= 0 or self.sweep_interval <= 0:
            raise ConfigError("registry ttl and sweep interval must be positive")
        if not 1 <= self.max_dp_size <= 4096 or not 1 <= self.max_tp_size <= 4096:
            raise ConfigError("--registry-max-dp-size and --registry-max-tp-size: 1-4096")

    def registration_problem(self, address: EngineAddress) -> str | None:
        """Why a registration (a keyless peer's) is refused, or None: sizes past the bounds,
        or a KV events endpoint that is an ``ipc://`` path or names a host other than the
        instance's own (``{host}``) and ``--registry-kv-events-host``'s."""
        if address.dp_size > self.max_dp_size:
            return f"dp_size {address.dp_size} exceeds --registry-max-dp-size {self.max_dp_size}"
        if address.tp_size > self.max_tp_size:
            return f"tp_size {address.tp_size} exceeds --registry-max-tp-size {self.max_tp_size}"
        own = url_host(address.url)
        for name, endpoint in (
            ("kv_events_endpoint", address.kv_events_endpoint),
            ("kv_events_replay_endpoint", address.kv_events_replay_endpoint),
        ):
            if endpoint is None:
                continue
            if not endpoint.startswith("tcp://"):
                return f"{name}: a registration may name only a tcp:// endpoint"
            host = endpoint_host(endpoint)
            if host not in ("{host}", own, *self.kv_events_hosts):
                return (
                    f"{name} names a host other than the instance's own; allow it with"
                    " --registry-kv-events-host"
                )
        return None


def url_host(url: str) -> str:
    """The host of ``http(s)://host:port`` as written (IPv6 without brackets)."""
    rest = url.split("://", 1)[-1].split("/", 1)[0]
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    return host.strip("[]")


def endpoint_host(endpoint: str) -> str:
    """The host part of ``tcp://host:port`` (IPv6 without brackets)."""
    rest = endpoint[len("tcp://") :]
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    return host.strip("[]")
