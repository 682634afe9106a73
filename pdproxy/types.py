"""Value objects shared by every layer of pdproxy (stdlib only)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

_MAX_KV_SOURCES = 1024


class Role(str, enum.Enum):
    """What an engine instance does in a disaggregated deployment."""

    PREFILL = "prefill"
    DECODE = "decode"


class ApiKind(str, enum.Enum):
    """The endpoint a generation request came in on; both legs use the same one.

    ``GENERATE`` is vLLM's token-in entrypoint (``--enable-scale-out``): token ids in,
    ``sampling_params`` as an object, ``stream`` and ``kv_transfer_params`` top-level.
    """

    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    GENERATE = "/inference/v1/generate"

    @property
    def path(self) -> str:
        return self.value


class EndpointState(str, enum.Enum):
    """Lifecycle of an endpoint in the registry."""

    PENDING = "pending"  # registered, waiting for its model probe
    READY = "ready"  # routable
    DRAINING = "draining"  # no new requests; in-flight ones finish


class ProbeState(str, enum.Enum):
    """What the active health checks say of an endpoint."""

    UNKNOWN = "unknown"  # not answered yet: not routable
    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"  # failed its probes: not routable until they pass again


class BreakerState(str, enum.Enum):
    """Passive health (outlier ejection) of an endpoint, as a circuit breaker."""

    CLOSED = "closed"  # in rotation
    OPEN = "open"  # ejected: no requests
    HALF_OPEN = "half_open"  # ejection over: one trial request decides


@dataclass(slots=True)
class EndpointHealth:
    """Active and passive health of one endpoint; written by the health book only
    (``resilience.outlier``'s ``OutlierDetector``: the probes and the legs' verdicts report
    to it). Mutated only on the event loop."""

    probe: ProbeState = ProbeState.HEALTHY
    probe_successes: int = 0  # consecutive
    probe_failures: int = 0  # consecutive
    probe_failed_while_ejected: bool = False
    consecutive_failures: int = 0  # request legs that failed by the instance's fault
    failures_before_success: int = 0  # what the last success reset (an untrusted answer)
    ejections: int = 0  # in a row, for the doubling; reset when it is back
    ejections_total: int = 0
    ejected_until: float | None = None  # monotonic; None = not ejected
    trial_in_flight: bool = False  # the half-open trial request is running
    overloaded_until: float = 0.0  # monotonic; it answered 429/408: others first until then
    # monotonic; a push decode leg closed while it waited for KV (its blocks may leak):
    # out of rotation until its KV usage is seen at 0 (resilience.outlier)
    stranded_at: float | None = None


class Source(str, enum.Enum):
    """Where an endpoint came from; only registered ones expire."""

    STATIC = "static"
    REGISTERED = "registered"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineAddress:
    """Where an engine listens: its HTTP base URL plus the connector's peer address."""

    url: str  # "http://host:port", no trailing slash
    zmq_address: str | None = None  # the KV side address embedded in request ids
    dp_size: int = 1
    tp_size: int = 1
    transfer_mode: str | None = None  # "READ" | "WRITE" for MoRIIO
    bootstrap_url: str | None = None  # Mooncake bootstrap server
    # where its vLLM KV events are (a template as --kv-events-endpoint's; None: the flag's)
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None

    @property
    def host_port(self) -> str:
        return self.url.split("://", 1)[1]


@dataclass(frozen=True, slots=True)
class RankLoad:
    """One data-parallel rank's figures from its engine's ``/metrics``."""

    rank: int
    running: float
    waiting: float
    kv_usage: float  # 0..1


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What an engine's ``/metrics`` said at one moment (vLLM's gauges): ``running`` and
    ``waiting`` summed over its DP ranks, ``kv_usage`` the fullest rank's (0..1), and the
    ranks themselves when the engine labels them (``engine="<rank>"``)."""

    running: float
    waiting: float
    kv_usage: float
    scraped_at: float  # monotonic
    ranks: tuple[RankLoad, ...] = ()
    own: float = 0.0  # this proxy's legs on the engine when the figures were read
    # Requests on the engine that are not this proxy's (other replicas', other clients').
    others: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "others", max(0.0, self.running + self.waiting - self.own))


@dataclass(frozen=True, slots=True, kw_only=True)
class EndpointIdentity:
    """What an engine instance is, fixed at admission: a re-probe that learns its models
    or engine ids makes a new identity, never edits this one. Set on an ``Endpoint`` by
    ``membership.identity`` only (its ``reidentify``)."""

    role: Role
    address: EngineAddress
    source: Source
    models: tuple[str, ...] = ()
    engine_ids: tuple[str, ...] = ()  # per DP rank (Mooncake)
    url: str = field(init=False)  # the address's, kept flat: the scheduler reads it per decision

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", self.address.url)

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: what the engine announced, or what its bootstrap listed."""
        return len(self.engine_ids) or self.address.dp_size

    @property
    def kv_address(self) -> str:
        """The address peers reach for KV; the HTTP host:port when none was announced."""
        return self.address.zmq_address or self.address.host_port


@dataclass(slots=True)
class Presence:
    """Where an endpoint is in its lifecycle; written by the fleet's registry only
    (``fleet.registry``: ``add``, ``set_state``, ``touch``, ``seen``, which membership calls
    on admission, drain and heartbeats)."""

    state: EndpointState = EndpointState.READY
    expires_at: float | None = None  # monotonic deadline; None = never expires
    last_seen: float | None = None  # wall-clock time of the last heartbeat


@dataclass(slots=True)
class LegCounts:
    """This proxy's legs on an endpoint; written by ``proxying.leg_counts`` only (``enter``,
    ``leave``, ``reserve``, ``unreserve``, ``read_from``, ``forget_kv_source(s)``, the last
    the health book's news that the engine's KV connections are gone); its methods are that
    module's to call. Mutated only on the event loop."""

    in_flight: int = 0
    # Legs in flight weighted by size (a prefill: its prompt over the typical), plus the
    # requests reserved on it: the scheduler's count of this proxy's load.
    work: float = 0.0
    reserved: int = 0  # requests bound for it whose leg has not started (a decode awaiting P)
    # The prompt tokens its prefill legs in flight still have to compute (each prompt less
    # its predicted hit; estimated where the token count is unknown): the queue in tokens
    # of work that ``kv-events`` weighs against a cached prefix (``scheduling.kv_cost``).
    queued_tokens: float = 0.0
    # Legs in flight per DP rank (index = rank), for rank balancing; grown on demand.
    rank_in_flight: list[int] = field(default_factory=list)
    # KV sources (NIXL: prefill engine ids) this decode has read from since it was last
    # seen healthy: a release through it is prompt. Insertion-ordered, capped.
    kv_sources: dict[str, None] = field(default_factory=dict)

    def read_from(self, source: str) -> None:
        """Remember that this decode has read KV from ``source``."""
        if source not in self.kv_sources:
            if len(self.kv_sources) >= _MAX_KV_SOURCES:
                del self.kv_sources[next(iter(self.kv_sources))]
            self.kv_sources[source] = None


@dataclass(slots=True)
class EngineFigures:
    """The engine's own load as its ``/metrics`` said it; written by the load scraper's
    ``apply_load`` only (``membership.load_scraper``: its own scrapes, and under
    ``--workers`` the owner's published figures, which ``membership.workers.link`` hands it)."""

    # The figures of its last /metrics scrape; None until one worked.
    engine_load: EngineLoad | None = None
    # The scheduler's copy of the figures' one number it reads per decision: the engine's
    # requests that are not this proxy's, trusted until ``others_until`` (monotonic).
    others: float = 0.0
    others_until: float = 0.0
    # Requests it runs at once, learned: the most it ran while others waited (0: unknown).
    capacity: int = 0


@dataclass(slots=True)
class Speed:
    """How fast an endpoint serves prefills, measured; written by
    ``scheduling.speed.SpeedTracker`` only."""

    seconds_per_token: float = 0.0  # its prefill legs' mean
    slowness: float = 1.0  # seconds_per_token over its role's typical; 1.0 until measured


@dataclass(slots=True, kw_only=True)
class Endpoint:
    """One engine instance as the proxy tracks it: its frozen identity and its live
    figures, each group in a record written by the one component that owns it (see each
    record's docstring; ``tests/unit/test_record_owners.py`` enforces it); everyone else
    reads. Which record object it holds is set by ``fleet.registry`` (a replacement takes
    its predecessor's ``LegCounts``) and its identity by ``membership.identity``."""

    identity: EndpointIdentity
    presence: Presence = field(default_factory=Presence)
    legs: LegCounts = field(default_factory=LegCounts)
    load: EngineFigures = field(default_factory=EngineFigures)
    speed: Speed = field(default_factory=Speed)
    health: EndpointHealth = field(default_factory=EndpointHealth)

    @classmethod
    def new(
        cls,
        *,
        role: Role,
        address: EngineAddress,
        source: Source,
        state: EndpointState = EndpointState.READY,
        models: tuple[str, ...] = (),
        engine_ids: tuple[str, ...] = (),
    ) -> Endpoint:
        """A newly admitted endpoint with no figures yet."""
        identity = EndpointIdentity(
            role=role, address=address, source=source, models=models, engine_ids=engine_ids
        )
        return cls(identity=identity, presence=Presence(state=state))

    @property
    def role(self) -> Role:
        return self.identity.role

    @property
    def address(self) -> EngineAddress:
        return self.identity.address

    @property
    def source(self) -> Source:
        return self.identity.source

    @property
    def models(self) -> tuple[str, ...]:
        return self.identity.models

    @property
    def engine_ids(self) -> tuple[str, ...]:
        return self.identity.engine_ids

    @property
    def url(self) -> str:
        return self.identity.url

    @property
    def dp_size(self) -> int:
        return self.identity.dp_size

    @property
    def kv_address(self) -> str:
        return self.identity.kv_address

    @property
    def state(self) -> EndpointState:
        return self.presence.state

    @property
    def routable(self) -> bool:
        """Admitted, not draining, and answering its health checks. (Ejection is a matter
        of time and is checked per request, not here.)"""
        return (
            self.presence.state is EndpointState.READY and self.health.probe is ProbeState.HEALTHY
        )


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The routable instances at one moment; what the scheduler sees."""

    prefill: tuple[Endpoint, ...]
    decode: tuple[Endpoint, ...]


@dataclass(frozen=True, slots=True)
class PairDecision:
    """The scheduler's choice for one request: a prefill, a decode and a DP rank on P."""

    prefill: Endpoint
    decode: Endpoint
    prefill_dp_rank: int | None = None
    decode_dp_rank: int | None = None  # sent to D only where the connector allows it
    # kv-events: the prompt tokens each engine's events say it holds (None: not followed)
    prefill_cached: int | None = None
    decode_cached: int | None = None


@dataclass(frozen=True, slots=True)
class DecodeOnly:
    """The scheduler's choice to serve a request on a decode alone, as a plain request:
    its prompt is too short to be worth a transfer (``short_prompt``), or no prefill is
    routable and ``--decode-only-fallback`` is on (``no_prefill``), or vLLM cannot split it
    across two legs (``parallel_sampling``, ``prompt_logprobs``: ``scheduling.features``)."""

    decode: Endpoint
    reason: str
    decode_dp_rank: int | None = None


@dataclass(frozen=True, slots=True)
class Registration:
    """What one registration message states about an instance, whatever its wire format:
    decoded by ``pdproxy.membership.discovery.messages``, admitted by ``Membership``."""

    role: Role
    address: EngineAddress
    format: str  # "p2p" | "moriio" | "moriio-legacy"
