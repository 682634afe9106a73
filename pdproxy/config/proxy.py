"""Frozen, validated-once configuration. No I/O here."""

from __future__ import annotations

import importlib
import ipaddress
import math
import secrets
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from pdproxy.config.addresses import (
    format_url,
    identity_host,
    listener_hosts,
    parse_engine_url,
    parse_host_port,
    url_host_port,
)
from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.errors import ConfigError
from pdproxy.types import EngineAddress

# KV connector name -> "module:Class" (uvicorn's name tables). A new transfer mode is one
# module under pdproxy/connectors/ plus one line here.
KV_CONNECTORS = MappingProxyType(
    {
        "nixl": "pdproxy.connectors.nixl:NixlConnector",
        "example": "pdproxy.connectors.example:ExampleConnector",
        "moriio": "pdproxy.connectors.moriio:MoriioConnector",
        "p2p-nccl": "pdproxy.connectors.p2p_nccl:P2pNcclConnector",
        "mooncake": "pdproxy.connectors.mooncake:MooncakeConnector",
    }
)


# MoRIIO's transfer modes: READ (D pulls, serial legs) and WRITE (P pushes, concurrent legs).
TRANSFER_MODES = ("READ", "WRITE")

# --log-format names, rendered by pdproxy.observability.log's formatters of the same names.
LOG_FORMATS = ("text", "json")


def import_from_string(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeouts:
    """Seconds; ``read`` bounds the silence between two upstream chunks, not a whole stream.

    ``prefill`` bounds a whole prefill leg (its answer is one token); ``decode_headers`` the
    wait for a streaming decode's response headers, which vLLM sends before generating.
    Past either, the leg is retried on another instance.
    """

    connect: float = 5.0
    read: float = 600.0
    probe: float = 2.0
    prefill: float = 30.0
    decode_headers: float = 30.0

    def __post_init__(self) -> None:
        for name in ("connect", "read", "probe", "prefill", "decode_headers"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"timeout {name} must be positive")


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolLimits:
    """Upstream connection pool; 0 means no cap (aiohttp's default of 100 would queue streams).

    ``keepalive_expiry`` stays below vLLM's 5 s uvicorn keep-alive so the proxy never writes
    into a socket the engine is closing. ``max_response_body_bytes`` caps an engine answer
    read whole (not a stream, which is relayed as it comes): 256 MiB is over what vLLM
    answers at the most (128k tokens with 20 top logprobs each are about 150 MB of JSON).
    """

    max_connections: int = 0
    max_connections_per_host: int = 0
    keepalive_expiry: float = 4.0
    max_response_body_bytes: int = 256 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.max_connections < 0 or self.max_connections_per_host < 0:
            raise ConfigError("connection limits must be >= 0")
        if self.max_response_body_bytes <= 0:
            raise ConfigError("--max-response-body-bytes must be positive")
        if not 0 < self.keepalive_expiry < 5:
            raise ConfigError("keepalive expiry must be in (0, 5) s, below vLLM's keep-alive")


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryConfig:
    """Retries of a failed leg on another instance, before the client's response starts.

    At most ``max_retries`` per request (0 turns retries off), and fleet-wide at most
    ``budget_ratio`` of the requests of the last ``budget_window`` seconds plus
    ``budget_min_per_sec``. Backoff applies only once every instance of a role was tried.
    """

    max_retries: int = 2
    budget_ratio: float = 0.2
    budget_window: float = 10.0
    budget_min_per_sec: float = 5.0
    initial_backoff: float = 0.05
    max_backoff: float = 1.0
    backoff_multiplier: float = 2.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ConfigError("--max-retries must be >= 0")
        if self.budget_ratio < 0 or self.budget_min_per_sec < 0 or self.budget_window <= 0:
            raise ConfigError("the retry budget's ratio and floor must be >= 0, its window > 0")
        if not 0 <= self.initial_backoff <= self.max_backoff:
            raise ConfigError("retry backoff: need 0 <= initial <= max")
        if self.backoff_multiplier < 1 or not 0 <= self.jitter <= 1:
            raise ConfigError("retry backoff: multiplier >= 1 and jitter in [0, 1]")


@dataclass(frozen=True, slots=True, kw_only=True)
class HealthConfig:
    """Active health checks: ``GET endpoint`` on every instance each ``interval`` seconds
    (0 turns them off), on the probe pool; and, on the same pool, a scrape of every
    instance's ``/metrics`` for its load each ``engine_metrics_interval`` seconds (0: off)."""

    interval: float = 5.0
    timeout: float = 2.0
    failure_threshold: int = 3
    success_threshold: int = 2
    endpoint: str = "/health"
    engine_metrics_interval: float = 1.0
    # pre-warmed pairs (``pdproxy.membership.warmup``): a new instance first runs one tiny PD
    # request with up to ``warm_pairs`` peers of the other role (0: off), for at most
    # ``warm_timeout``
    warm_pairs: int = 0
    warm_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.interval < 0 or self.timeout <= 0:
            raise ConfigError("health check interval must be >= 0 and its timeout > 0")
        if not 0 <= self.engine_metrics_interval < math.inf:
            raise ConfigError("--engine-metrics-interval-secs must be >= 0")
        if self.failure_threshold < 1 or self.success_threshold < 1:
            raise ConfigError("health check thresholds must be >= 1")
        if not self.endpoint.startswith("/"):
            raise ConfigError("--health-check-endpoint must start with /")
        if self.warm_pairs < 0 or self.warm_timeout <= 0:
            raise ConfigError("--warm-pairs must be >= 0 and --warm-timeout-secs > 0")

    @property
    def enabled(self) -> bool:
        return self.interval > 0


@dataclass(frozen=True, slots=True, kw_only=True)
class OutlierConfig:
    """Passive health: ejection after ``consecutive_failures`` failed legs (0 turns it off)
    for ``base_ejection`` seconds, doubling up to ``max_ejection``."""

    consecutive_failures: int = 3
    base_ejection: float = 5.0
    max_ejection: float = 60.0
    max_ejection_percent: float = 50.0
    overload_cooldown: float = 1.0  # after a 429/408, peers first for this long (0: off)

    def __post_init__(self) -> None:
        if self.overload_cooldown < 0:
            raise ConfigError("--overload-cooldown-secs must be >= 0")
        if self.consecutive_failures < 0:
            raise ConfigError("--outlier-consecutive-failures must be >= 0")
        if not 0 < self.base_ejection <= self.max_ejection:
            raise ConfigError("ejection times: need 0 < base <= max")
        if not 0 <= self.max_ejection_percent <= 100:
            raise ConfigError("--max-ejection-percent must be in 0-100")


CERT_REQS = (0, 1, 2)  # ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED, as uvicorn and vLLM


@dataclass(frozen=True, slots=True, kw_only=True)
class ListenerTLS:
    """HTTPS to clients (uvicorn's and vLLM's --ssl-* flags); ``cert_reqs`` 2 with
    ``ca_certs`` demands a client certificate signed by that CA."""

    keyfile: str | None = None
    certfile: str | None = None
    ca_certs: str | None = None
    cert_reqs: int = 0

    def __post_init__(self) -> None:
        if (self.keyfile is None) != (self.certfile is None):
            raise ConfigError("--ssl-keyfile and --ssl-certfile go together")
        if self.cert_reqs not in CERT_REQS:
            raise ConfigError("--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required)")
        if self.cert_reqs and (self.certfile is None or self.ca_certs is None):
            raise ConfigError("--ssl-cert-reqs needs --ssl-certfile and --ssl-ca-certs")

    @property
    def enabled(self) -> bool:
        return self.certfile is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineTLS:
    """HTTPS to ``https://`` engines: the CA that signed them (else the system's), and a
    client certificate for mTLS."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None

    def __post_init__(self) -> None:
        if (self.keyfile is None) != (self.certfile is None):
            raise ConfigError("--engine-client-cert and --engine-client-key go together")


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionConfig:
    """At most ``max_concurrent`` client requests served at once (0: no limit) and at most
    ``max_queued`` waiting for a slot, each no longer than ``queue_timeout`` seconds; past
    either limit the client gets 429 at once."""

    max_concurrent: int = 0
    max_queued: int = 0
    queue_timeout: float = 30.0

    def __post_init__(self) -> None:
        if self.max_concurrent < 0 or self.max_queued < 0:
            raise ConfigError("--max-concurrent-requests and --max-queued-requests must be >= 0")
        if self.queue_timeout <= 0:
            raise ConfigError("--queue-timeout-secs must be positive")
        if self.max_queued and not self.max_concurrent:
            raise ConfigError("--max-queued-requests needs --max-concurrent-requests")

    @property
    def enabled(self) -> bool:
        return self.max_concurrent > 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientLimits:
    """Bounds on client connections, enforced below ASGI (``pdproxy.runtime.listener``).

    A request head past ``max_head_bytes`` or ``max_headers`` fields gets 431 and the
    connection closes; a head not complete ``header_timeout`` seconds after the connect or
    the previous response, or a body silent for ``body_timeout`` seconds, closes it.
    ``keepalive_timeout`` is uvicorn's idle keep-alive. Past ``max_connections`` (0: half the
    process's open-file limit) the oldest idle connection is closed, or the new one gets 503.
    """

    max_head_bytes: int = 64 * 1024
    max_headers: int = 128
    header_timeout: float = 30.0
    body_timeout: float = 30.0
    keepalive_timeout: int = 5
    max_connections: int = 0

    def __post_init__(self) -> None:
        if self.max_head_bytes < 1024 or self.max_headers < 1:
            raise ConfigError("--max-request-head-bytes >= 1024, --max-request-headers >= 1")
        if self.header_timeout <= 0 or self.body_timeout <= 0:
            raise ConfigError("--client-header/body-timeout-secs must be positive")
        if self.keepalive_timeout < 1:
            raise ConfigError("--client-keepalive-timeout-secs must be >= 1")
        if self.max_connections < 0:
            raise ConfigError("--max-client-connections must be >= 0")


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


MAX_WORKERS = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    prefill: tuple[EngineAddress, ...] = ()
    decode: tuple[EngineAddress, ...] = ()
    kv_connector: str = "nixl"
    model: str | None = None
    transfer_mode: str | None = None
    max_body_bytes: int = 32 * 1024 * 1024
    timeouts: Timeouts = field(default_factory=Timeouts)
    pool: PoolLimits = field(default_factory=PoolLimits)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    outlier: OutlierConfig = field(default_factory=OutlierConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    admin_api_key: str | None = field(default=None, repr=False)
    admin_allow_cidrs: tuple[str, ...] = ()
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # clients' Bearer keys
    protect_metrics: bool = False  # /metrics and /dashboard/data need a client key too
    dashboard: bool = True  # GET /dashboard and /dashboard/data (--no-dashboard: off)
    engine_api_key: str | None = field(default=None, repr=False)  # pdproxy's key to engines
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    clients: ClientLimits = field(default_factory=ClientLimits)
    shutdown_timeout: float = 30.0
    tls: ListenerTLS = field(default_factory=ListenerTLS)
    engine_tls: EngineTLS = field(default_factory=EngineTLS)
    log_level: str = "info"
    log_format: str = "text"  # one of LOG_FORMATS
    access_log: bool = True  # pdproxy's own line per generation request (pdproxy.access)
    otlp_traces_endpoint: str | None = None  # OTLP/HTTP collector URL; None: no tracing
    # tokenize once (pdproxy.proxying.render_once): text requests rendered once, legs on token ids,
    # on these `vllm launch render` servers (none: on a decode)
    render_once: bool = False
    render: tuple[EngineAddress, ...] = ()
    workers: int = 1  # serving processes (pdproxy.runtime); 1: this process serves
    # This pdproxy's hop marker in the Via header of its legs (pdproxy.membership.guard): random per
    # run, the same in every --workers process (they get this config).
    hop_id: str = field(default_factory=lambda: secrets.token_hex(8), repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            names = ", ".join(sorted(KV_CONNECTORS))
            raise ConfigError(f"unknown --kv-connector {self.kv_connector!r}; choose from {names}")
        if (
            self.registry.port is None
            and not self.registry.shared.enabled
            and not (self.prefill and self.decode)
        ):
            raise ConfigError(
                "give at least one --prefill and one --decode (or --registry-port, or a shared"
                " --registry-backend)"
            )
        if self.max_body_bytes <= 0:
            raise ConfigError("--max-body-bytes must be positive")
        if not 0 <= self.port <= 65535:
            raise ConfigError("--port must be in 0-65535")
        if any(not key or key != key.strip() for key in self.api_keys):
            raise ConfigError("an --api-key must be non-empty, without surrounding spaces")
        if self.protect_metrics and not self.api_keys:
            raise ConfigError("--protect-metrics needs --api-key")
        if not 1 <= self.workers <= MAX_WORKERS:
            raise ConfigError(f"--workers must be in 1-{MAX_WORKERS}")
        if self.shutdown_timeout < 0:
            raise ConfigError("--shutdown-timeout-secs must be >= 0")
        if self.render and not self.render_once:
            raise ConfigError("--render needs --render-once")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"--log-format must be one of {', '.join(LOG_FORMATS)}")
        for cidr in self.admin_allow_cidrs:
            try:
                ipaddress.ip_network(cidr, strict=False)
            except ValueError as exc:
                raise ConfigError(f"--admin-allow-cidr {cidr!r} is not a CIDR") from exc
        for address in (*self.prefill, *self.decode, *self.render):
            if self._names_itself(address.url):
                raise ConfigError(f"{address.url} is pdproxy's own listener: a routing loop")

    def _names_itself(self, url: str) -> bool:
        """``url`` is literally this listener (its loopback or host, its port); the
        membership also checks the host's other addresses (``pdproxy.membership.guard``)."""
        try:
            host, port = url_host_port(url)
        except ConfigError:  # not parsed by the CLI (a test's or an embedder's address)
            return False
        if not self.port or port != self.port:
            return False
        return identity_host(host) in listener_hosts(self.host)
