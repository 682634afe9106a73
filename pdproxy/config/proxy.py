"""The whole configuration of one pdproxy (``ProxyConfig``) and the name tables its flags choose
from; each section of it lives in its own module beside this one."""

from __future__ import annotations

import importlib
import ipaddress
import secrets
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from pdproxy.config.addresses import identity_host, listener_hosts, url_host_port
from pdproxy.config.listener import AdmissionConfig, ClientLimits, ListenerTLS
from pdproxy.config.lora import LoraConfig
from pdproxy.config.registry import RegistryConfig
from pdproxy.config.resilience import HealthConfig, OutlierConfig, RetryConfig
from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.config.tenants import TenantsConfig
from pdproxy.config.upstream import EngineTLS, PoolLimits, Timeouts
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
        "nixl-push": "pdproxy.connectors.nixl_push:NixlPushConnector",
    }
)

# MoRIIO's transfer modes: READ (D pulls, serial legs) and WRITE (P pushes, concurrent legs).
TRANSFER_MODES = ("READ", "WRITE")

# --push-dispatch (nixl-push): when both legs go at once (pdproxy.connectors.nixl_push).
PUSH_DISPATCH = ("auto", "concurrent", "serial")

# --log-format names, rendered by pdproxy.observability.log's formatters of the same names.
LOG_FORMATS = ("text", "json")


def import_from_string(target: str) -> Any:
    module_name, _, attr = target.partition(":")
    return getattr(importlib.import_module(module_name), attr)


MAX_WORKERS = 256


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    prefill: tuple[EngineAddress, ...] = ()
    decode: tuple[EngineAddress, ...] = ()
    kv_connector: str = "nixl"
    model: str | None = None
    lora: LoraConfig = field(default_factory=LoraConfig)
    transfer_mode: str | None = None
    # one of PUSH_DISPATCH (--kv-connector nixl-push); serial: measured faster on shared cores
    push_dispatch: str = "serial"
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
    # (key, tenant) of the --api-key-file lines that name a tenant (docs/flow-control.md)
    key_tenants: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    tenants: TenantsConfig = field(default_factory=TenantsConfig)  # --tenants, --tenant-header
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
    # the prefill's sampled token is the stream's first (pdproxy.proxying.first_token); NIXL only
    first_token_from_prefill: bool = False
    workers: int = 1  # serving processes (pdproxy.runtime); 1: this process serves
    # This pdproxy's hop marker in the Via header of its legs (pdproxy.wire.hop): random per
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
        if self.first_token_from_prefill and self.kv_connector != "nixl":
            raise ConfigError(
                "--first-token-from-prefill is exact only with --kv-connector nixl"
                f" (a pull of the prompt's blocks), not {self.kv_connector!r}"
            )
        if self.push_dispatch not in PUSH_DISPATCH:
            raise ConfigError(f"--push-dispatch must be one of {', '.join(PUSH_DISPATCH)}")
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
