"""How pdproxy talks to the engines: timeouts, the connection pool's limits, TLS towards
``https://`` engines."""

from __future__ import annotations

from dataclasses import dataclass

from pdproxy.errors import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeouts:
    """Seconds; ``read`` bounds the silence between two upstream chunks, not a whole stream.

    ``prefill`` bounds a whole prefill leg (its answer is one token); ``decode_headers`` the
    wait for a streaming decode's response headers, which vLLM sends before generating.
    Past either, the leg is retried on another instance. ``push_wait`` bounds a push decode's
    wait for its first streamed byte once its prefill answered (the write follows within
    milliseconds; vLLM's decode would wait for ever), under the prefill's 30 s KV lease.
    """

    connect: float = 5.0
    read: float = 600.0
    probe: float = 2.0
    prefill: float = 30.0
    decode_headers: float = 30.0
    push_wait: float = 20.0

    def __post_init__(self) -> None:
        for name in ("connect", "read", "probe", "prefill", "decode_headers", "push_wait"):
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
    # a relayed stream: one SSE event of a stream that may migrate (its bytes are kept
    # until the event ends), and a whole stream; past either it ends with the error event
    max_stream_event_bytes: int = 4 * 1024 * 1024
    max_stream_bytes: int = 1024 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.max_connections < 0 or self.max_connections_per_host < 0:
            raise ConfigError("connection limits must be >= 0")
        if self.max_response_body_bytes <= 0:
            raise ConfigError("--max-response-body-bytes must be positive")
        if self.max_stream_event_bytes <= 0 or self.max_stream_bytes <= 0:
            raise ConfigError("--max-stream-event-bytes and --max-stream-bytes must be positive")
        if not 0 < self.keepalive_expiry < 5:
            raise ConfigError("keepalive expiry must be in (0, 5) s, below vLLM's keep-alive")


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
