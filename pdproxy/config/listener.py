"""The client side: HTTPS to clients, admission control (how many requests are served at once, how
many wait) and the bounds on one client's connection (its request head, its silences, how many
connections)."""

from __future__ import annotations

from dataclasses import dataclass

from pdproxy.errors import ConfigError

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
class AdmissionConfig:
    """At most ``max_concurrent`` client requests served at once (0: no limit) and at most
    ``max_queued`` waiting for a slot, each no longer than ``queue_timeout`` seconds; past
    either limit the client gets 429 at once."""

    max_concurrent: int = 0
    max_queued: int = 0
    queue_timeout: float = 30.0
    # Requests one prefill (decode) instance runs at once, past which its role's legs wait
    # in pdproxy (flow control); None: learned from its /metrics; 0: legs never wait.
    prefill_capacity: int | None = None
    decode_capacity: int | None = None

    def __post_init__(self) -> None:
        if self.max_concurrent < 0 or self.max_queued < 0:
            raise ConfigError("--max-concurrent-requests and --max-queued-requests must be >= 0")
        for name, value in (
            ("--prefill-capacity", self.prefill_capacity),
            ("--decode-capacity", self.decode_capacity),
        ):
            if value is not None and not 0 <= value <= 1_000_000:
                raise ConfigError(f"{name} must be between 0 and 1000000")
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
