"""KV connector adapters: how each vLLM KV connector wants the two legs shaped.

An adapter is pure policy: it turns the client's body and the scheduler's decision into
the prefill and decode bodies, and says whether the legs run one after the other (P must
finish before D starts) or together. It never does I/O; what it must learn from an engine
(Mooncake's engine ids) it names as a URL and parses from the answer the caller fetched.

Adapters are chosen by name through ``pdproxy.config.proxy.KV_CONNECTORS``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pdproxy.config.proxy import KV_CONNECTORS, ProxyConfig, import_from_string
from pdproxy.errors import ConfigError
from pdproxy.types import EngineAddress, PairDecision
from pdproxy.wire.shaping import JSONBody, client_request_id, decode_body, prefill_body

# Retry reasons (pdproxy.resilience.retry) that prove the decode engine never saw the leg.
NEVER_REACHED_DECODE = frozenset({"connect"})


@dataclass(frozen=True, slots=True)
class ReleaseLeg:
    """A decode leg sent only to release a prefill's KV; ``expect`` is the status that shows
    the engine acted on it."""

    path: str
    body: JSONBody
    expect: int


@dataclass(frozen=True, slots=True)
class Transfer:
    """Per-request transfer identity, shared by both legs."""

    decision: PairDecision
    request_id: str
    transfer_id: str | None = None
    # A connector's own state for this transfer, fixed when it began (nixl-push: the
    # prefill's NIXL coordinates as then known, so both legs agree on them).
    peer: object | None = None


class KVConnector(Protocol):
    # True when D may be told its DP rank (X-data-parallel-rank): the KV reaches any rank
    # of D alike (a pull, or shared storage). Push connectors address a rank themselves.
    routes_decode_rank: bool
    # True when a decode can serve a request by itself (decode-only requests); False when
    # it always waits for KV from the prefill its request id names (P2P-NCCL).
    serves_decode_alone: bool

    def begin(self, decision: PairDecision, client_request_id: str | None) -> Transfer:
        """Fix the request id (and any transfer id) that both legs carry."""
        ...

    def runs_concurrently(self, transfer: Transfer) -> bool:
        """True when P and D are sent together (push / WRITE); False: P finishes first."""
        ...

    def decode_retry_reuses_prefill(self, transfer: Transfer, reason: str) -> bool:
        """May a decode that failed for ``reason`` be retried on another decode with this
        prefill's answer? True only when the KV is certainly still where any decode can
        read it; otherwise the orchestrator re-runs the pair with a fresh prefill."""
        ...

    def prefill_body(self, original: Mapping[str, Any], transfer: Transfer) -> JSONBody:
        """The body for P: clamped to one token, with this connector's params."""
        ...

    def decode_body(
        self,
        original: Mapping[str, Any],
        transfer: Transfer,
        prefill_response: Mapping[str, Any] | None,
    ) -> JSONBody:
        """The body for D; ``prefill_response`` is P's JSON answer in serial mode, else None."""
        ...

    def observe_prefill(self, decision: PairDecision, answer: Mapping[str, Any]) -> None:
        """A prefill leg of ``decision`` answered ``answer`` (2xx): learn from it what the
        next transfers need (NIXL push: the prefill's coordinates)."""
        ...

    def prefill_failed(self, decision: PairDecision) -> None:
        """A prefill leg of ``decision`` failed: forget what it taught (it may restart)."""
        ...

    def kv_source(self, prefill_response: Mapping[str, Any]) -> str | None:
        """Which KV source a decode reads ``prefill_response``'s blocks from (NIXL: P's
        engine id), for tracking the decodes that have a connection to it; None if moot."""
        ...

    def release_leg(
        self,
        original: Mapping[str, Any],
        prefill_response: Mapping[str, Any],
        *,
        warm: bool,
    ) -> ReleaseLeg | None:
        """A short decode leg that makes a decode engine release ``prefill_response``'s KV,
        which no decode will read; ``warm`` when that decode already reads from the same
        source. None when there is nothing to release or no way to."""
        ...

    def prefill_bootstrap_url(self, address: EngineAddress) -> str | None:
        """A URL to GET before a prefill is routable, or None."""
        ...

    def parse_bootstrap(self, answer: Any) -> tuple[str, ...]:
        """Engine ids by DP rank from the bootstrap answer; raises ValueError if unusable."""
        ...


class SerialConnector:
    """Defaults shared by the adapters: serial legs, the client's request id, no
    ``kv_transfer_params`` on either leg, no bootstrap."""

    routes_decode_rank = False
    serves_decode_alone = True

    @classmethod
    def from_config(cls, config: ProxyConfig) -> SerialConnector:
        return cls()

    def begin(self, decision: PairDecision, client_request_id_: str | None) -> Transfer:
        return Transfer(decision, client_request_id(client_request_id_))

    def runs_concurrently(self, transfer: Transfer) -> bool:
        return False

    def decode_retry_reuses_prefill(self, transfer: Transfer, reason: str) -> bool:
        # A pull: P holds the blocks until a decode has read them. Once a decode may have
        # read them, P may have freed (and reused) them, and another decode would read
        # garbage; so only a decode that was never reached leaves them certainly intact.
        return reason in NEVER_REACHED_DECODE

    def prefill_body(self, original: Mapping[str, Any], transfer: Transfer) -> JSONBody:
        return prefill_body(original, None)

    def decode_body(
        self,
        original: Mapping[str, Any],
        transfer: Transfer,
        prefill_response: Mapping[str, Any] | None,
    ) -> JSONBody:
        return decode_body(original, None)

    def observe_prefill(self, decision: PairDecision, answer: Mapping[str, Any]) -> None:
        return None

    def prefill_failed(self, decision: PairDecision) -> None:
        return None

    def kv_source(self, prefill_response: Mapping[str, Any]) -> str | None:
        return None

    def release_leg(
        self,
        original: Mapping[str, Any],
        prefill_response: Mapping[str, Any],
        *,
        warm: bool,
    ) -> ReleaseLeg | None:
        return None

    def prefill_bootstrap_url(self, address: EngineAddress) -> str | None:
        return None

    def parse_bootstrap(self, answer: Any) -> tuple[str, ...]:
        return ()


def load_connector(config: ProxyConfig) -> KVConnector:
    try:
        factory = import_from_string(KV_CONNECTORS[config.kv_connector])
    except KeyError as exc:
        raise ConfigError(f"unknown kv connector {config.kv_connector!r}") from exc
    connector: KVConnector = factory.from_config(config)
    return connector
