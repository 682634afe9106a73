"""Configuration of one simulated vLLM engine: every knob, frozen, with defaults."""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from engines.sim.lora import parse_lora_modules

Role = Literal["prefill", "decode", "both"]
ConnectorName = Literal["nixl", "nixl-push", "example", "moriio", "p2p-nccl", "mooncake"]
RegisterFormat = Literal["p2p", "moriio", "moriio-legacy"]
TransferMode = Literal["READ", "WRITE"]
REGISTER_FORMATS = ("p2p", "moriio", "moriio-legacy")
TRANSFER_MODES = ("READ", "WRITE")
CERT_REQS = (0, 1, 2)  # ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED, as vLLM's --ssl-cert-reqs


@dataclass(frozen=True)
class Faults:
    """Faults the sim injects; all off by default. Settable at start and at run time."""

    status: int | None = None  # answer every generation request with this HTTP status
    hang: bool = False  # accept generation requests and never answer
    close_after_tokens: int | None = None  # abort the TCP connection after N streamed tokens
    refuse_connections: bool | float = False  # close the listener; a number restores it after N s
    slow_start_s: float = 0.0  # /health answers 503 for N s after the fault is set
    headers_delay_s: float = 0.0  # generation: wait N s before sending anything
    reset_after_bytes: int | None = None  # generation: headers + N body bytes, then a TCP RST
    hang_after_tokens: int | None = None  # go silent after N tokens until the client leaves
    # streams: N tokens, then vLLM's mid-stream error event and [DONE] (an internal error
    # during generation); a whole answer gets vLLM's 500
    error_after_tokens: int | None = None
    fail_kv_load: bool = False  # a decode's remote KV load fails (policy "fail": 500)
    health_delay_s: float = 0.0  # /health and /ping answer after N s
    health_status: int | None = None  # /health and /ping answer this status (generation works)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Faults:
        """Build from a JSON object; unknown keys raise ValueError."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown fault(s): {sorted(unknown)}")
        faults = cls(**data)
        faults.validate()
        return faults

    def validate(self) -> None:
        for name in ("status", "health_status"):
            value = getattr(self, name)
            if value is not None and not 100 <= int(value) <= 599:
                raise ValueError(f"{name} must be an HTTP status code")
        for name in (
            "close_after_tokens",
            "reset_after_bytes",
            "hang_after_tokens",
            "error_after_tokens",
        ):
            value = getattr(self, name)
            if value is not None and int(value) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("slow_start_s", "headers_delay_s", "health_delay_s"):
            if float(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _engine_id() -> str:
    return str(uuid.uuid4())


@dataclass(frozen=True)
class SimConfig:
    """All knobs of one sim engine. `port=0` and `kv_port=0` pick free ports."""

    host: str = "127.0.0.1"
    port: int = 0
    model: str = "sim-model"
    served_models: tuple[str, ...] = ()  # more base models besides ``model``
    lora_modules: tuple[str, ...] = ()  # NAME=PATH adapters loaded at start (vLLM's flag)
    max_model_len: int = 4096
    role: Role = "both"
    connector: ConnectorName = "nixl"
    engine_id: str = field(default_factory=_engine_id)
    kv_host: str = "127.0.0.1"  # reported as remote_host; the side channel binds here
    kv_port: int = 0
    kv_lease_s: float = 30.0
    kv_dir: str | None = None  # shared storage directory for the example connector
    block_size: int = 16
    num_blocks: int = 4096
    dp_size: int = 1
    tp_size: int = 1  # reported only (registration, MoRIIO params); the sim runs one rank
    transfer_mode: TransferMode = "READ"  # MoRIIO: READ (D pulls, serial) or WRITE (P pushes)
    kv_wait_timeout_s: float = 30.0  # how long a decode waits for pushed/pulled KV
    bootstrap_port: int = 0  # Mooncake bootstrap HTTP server (vLLM default 8998); 0 = free
    register: str | None = None  # tcp://host:port of a proxy's ROUTER; None = no heartbeats
    register_format: RegisterFormat = "p2p"
    register_interval_s: float = 3.0
    zmq_address: str | None = None  # registered zmq_address; None = derived from the KV port
    strict: bool = False
    ttft_ms: float = 0.0
    prefill_us_per_token: float = 0.0
    decode_tps: float = 0.0
    max_running: int = 256
    # vLLM's --scheduling-policy: "fcfs", or "priority" (waiting requests by the body's
    # priority, then arrival)
    scheduling_policy: str = "fcfs"
    prefill_concurrency: int = 0  # prefill compute lanes per DP rank (FIFO); 0 = unlimited
    prefix_cache_blocks: int = 8192  # capacity of the prefix cache, in blocks
    # vLLM's --kv-events-config: a PUB (and ROUTER replay) socket bound here; "map" events
    # as vLLM 0.32, "array" as earlier releases (engines/sim/kv_events.py); "{port}" in
    # them is the HTTP port (so a test's pdproxy finds them from a template)
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_encoding: str = "map"
    keep_alive_s: float = 5.0  # idle keep-alive timeout, as VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    record_limit: int = 10000  # how many request records /sim/requests keeps
    # /v1/responses keeps responses for previous_response_id (vLLM's
    # VLLM_ENABLE_RESPONSES_API_STORE=1; off by default there too)
    responses_store: bool = False
    # HTTPS as vLLM's --ssl-* flags (the KV side channel stays plain TCP)
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None  # CA that signs client certificates
    ssl_cert_reqs: int = 0  # 2: a client certificate signed by ssl_ca_certs is required
    faults: Faults = field(default_factory=Faults)

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill, decode or both, not {self.role!r}")
        if self.block_size < 1 or self.num_blocks < 1 or self.dp_size < 1:
            raise ValueError("block_size, num_blocks and dp_size must be >= 1")
        if self.max_running < 1:
            raise ValueError("max_running must be >= 1")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("scheduling_policy must be fcfs or priority")
        if self.prefill_concurrency < 0:
            raise ValueError("prefill_concurrency must be >= 0 (0 = unlimited)")
        if self.tp_size < 1:
            raise ValueError("tp_size must be >= 1")
        if self.transfer_mode not in TRANSFER_MODES:
            raise ValueError(f"transfer_mode must be READ or WRITE, not {self.transfer_mode!r}")
        if self.register_format not in REGISTER_FORMATS:
            raise ValueError(f"register_format must be one of {REGISTER_FORMATS}")
        if self.register_interval_s <= 0 or self.kv_wait_timeout_s <= 0:
            raise ValueError("register_interval_s and kv_wait_timeout_s must be > 0")
        if self.connector == "example" and self.role != "both" and not self.kv_dir:
            raise ValueError("the example connector needs kv_dir")
        parse_lora_modules(self.lora_modules)  # raises ValueError for a bad one
        if self.kv_events_encoding not in ("map", "array"):
            raise ValueError("kv_events_encoding must be map or array")
        self._validate_tls()
        self.faults.validate()

    def _validate_tls(self) -> None:
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile go together")
        if self.ssl_cert_reqs not in CERT_REQS:
            raise ValueError("ssl_cert_reqs must be 0 (none), 1 (optional) or 2 (required)")
        if self.ssl_cert_reqs and (self.ssl_certfile is None or self.ssl_ca_certs is None):
            raise ValueError("ssl_cert_reqs needs ssl_certfile and ssl_ca_certs")

    @property
    def tls(self) -> bool:
        """True when the HTTP server speaks HTTPS."""
        return self.ssl_certfile is not None

    @property
    def engine_ids(self) -> list[str]:
        """Engine id per DP rank: the plain id with one rank, else vLLM's `<id>_dp<rank>`."""
        if self.dp_size == 1:
            return [self.engine_id]
        return [f"{self.engine_id}_dp{rank}" for rank in range(self.dp_size)]

    @property
    def instant(self) -> bool:
        """True when no timing knob asks for a delay (requests may be served inline)."""
        return self.ttft_ms <= 0 and self.prefill_us_per_token <= 0 and self.decode_tps <= 0
