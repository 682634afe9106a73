"""NixlPushConnector (vLLM 0.32, ``--kv-connector nixl-push``): P writes the KV into D.

The decode allocates its blocks and registers them with the prefill over NIXL; when the
prefill's one-token request finishes, it writes the KV into them. So both legs may be sent
at once (concurrent), or P first and its answer verbatim to D (serial, as pull). What vLLM
0.32 requires (docs/push.md has the measurements, PROTOCOLS.md the contract):

* both legs carry the same ``X-Request-Id`` on the same endpoint family, P on the DP rank
  D names (P matches a registration by the internal id less its random suffix);
* P: ``do_remote_decode`` and one token, not streamed (a longer prefill shifts the KV);
* D, concurrent: ``do_remote_prefill``, P's ``remote_engine_id`` (``_dp<rank>`` with DP),
  ``remote_host``, ``remote_port`` (its side channel, per rank), ``tp_size`` and
  ``remote_request_id``; a missing one kills D's engine (a ``KeyError`` in its scheduler).

No endpoint exposes P's NIXL coordinates: they are learned from P's answers (``PushPeers``)
and the first request to a prefill rank is always serial. A prefill that answers with
another engine id restarted: its coordinates are replaced; one whose leg fails is forgotten
(re-learned from its next answer). Nothing is guessed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdproxy.config.proxy import ProxyConfig
from pdproxy.connectors import ReleaseLeg, Transfer
from pdproxy.connectors.nixl import NixlConnector
from pdproxy.types import PairDecision
from pdproxy.wire.kv_params import (
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    KV_TRANSFER_PARAMS,
    REMOTE_ENGINE_ID,
    REMOTE_HOST,
    REMOTE_PORT,
)
from pdproxy.wire.shaping import JSONBody, decode_body, prefill_body

logger = logging.getLogger(__name__)

PREFILL_PARAMS: Mapping[str, Any] = {DO_REMOTE_DECODE: True}
_MAX_FIELD = 512  # an engine id or host longer than this is not learned (a hostile answer)
_MAX_PEERS = 4096  # (prefill, rank) pairs remembered; the oldest goes first


@dataclass(frozen=True, slots=True)
class PushCoordinates:
    """One prefill rank's NIXL side as its own answer said it."""

    engine_id: str
    host: str
    port: int
    tp_size: int
    pp_size: int = 1


def coordinates(params: object) -> PushCoordinates | None:
    """The coordinates in a push prefill's ``kv_transfer_params``, or None when they are
    missing, not push, or not of the types vLLM sends (nothing is coerced)."""
    if not isinstance(params, dict) or params.get("transfer_mode") != "push":
        return None
    engine_id, host = params.get(REMOTE_ENGINE_ID), params.get(REMOTE_HOST)
    port, tp, pp = params.get(REMOTE_PORT), params.get("tp_size"), params.get("pp_size", 1)
    if not (isinstance(engine_id, str) and isinstance(host, str)):
        return None
    if not (0 < len(engine_id) <= _MAX_FIELD and 0 < len(host) <= _MAX_FIELD):
        return None
    if not (type(port) is int and type(tp) is int and type(pp) is int):
        return None
    if not (0 < port < 65536 and 0 < tp <= 1024 and 0 < pp <= 1024):
        return None
    return PushCoordinates(engine_id, host, port, tp, pp)


def _whole_leg(params: dict[str, Any]) -> bool:
    """Do a push prefill's params hold every key vLLM's push decode reads, as it sends them?"""
    request_id = params.get("remote_request_id")
    return (
        coordinates(params) is not None
        and isinstance(request_id, str)
        and 0 < len(request_id) <= _MAX_FIELD
    )


class PushPeers:
    """The prefill ranks' NIXL coordinates, learned from their answers; written through
    ``learn`` and ``forget`` only (the request path's prefill legs), read by the connector."""

    def __init__(self) -> None:
        self._by_rank: dict[tuple[str, int], PushCoordinates] = {}
        self.restarts = 0  # answers that named another engine id for a known rank

    def get(self, url: str, rank: int | None) -> PushCoordinates | None:
        return self._by_rank.get((url, rank or 0))

    def learn(self, url: str, rank: int | None, params: object) -> None:
        found = coordinates(params)
        if found is None:
            return
        key = (url, rank or 0)
        known = self._by_rank.get(key)
        if known == found:
            return
        other = self.owner(found)
        if other is not None and other != key:
            # Another prefill rank's engine id or side channel: a decode sent there would
            # register with that engine, which never writes this request (a hostile or
            # misconfigured answer). Not learned; the legs stay serial.
            logger.warning(
                "prefill %s rank %d answered NIXL coordinates of %s rank %d: not learned",
                url,
                key[1],
                *other,
            )
            return
        if known is not None and known.engine_id != found.engine_id:
            self.restarts += 1
            logger.warning(
                "prefill %s rank %d answered as NIXL engine %s, not %s: it restarted",
                url,
                key[1],
                found.engine_id,
                known.engine_id,
            )
        elif known is None and len(self._by_rank) >= _MAX_PEERS:
            del self._by_rank[next(iter(self._by_rank))]
        self._by_rank[key] = found

    def owner(self, found: PushCoordinates) -> tuple[str, int] | None:
        """The prefill rank already known under ``found``'s engine id or side channel."""
        for key, known in self._by_rank.items():
            if known.engine_id == found.engine_id or (known.host, known.port) == (
                found.host,
                found.port,
            ):
                return key
        return None

    def forget(self, url: str) -> None:
        """Every rank of ``url``: its next request is serial and re-learns them (it may
        have restarted under the same engine id, which no answer would show)."""
        for key in [k for k in self._by_rank if k[0] == url]:
            del self._by_rank[key]

    def known(self) -> int:
        return len(self._by_rank)


class NixlPushConnector(NixlConnector):
    """Serial NIXL's forwarding of P's answer, plus concurrent legs where they pay."""

    def __init__(self, dispatch: str = "serial") -> None:
        self.dispatch = dispatch
        self.peers = PushPeers()

    @classmethod
    def from_config(cls, config: ProxyConfig) -> NixlPushConnector:
        return cls(config.push_dispatch)

    def begin(self, decision: PairDecision, client_request_id_: str | None) -> Transfer:
        transfer = super().begin(decision, client_request_id_)
        peer = self.peers.get(decision.prefill.url, decision.prefill_dp_rank)
        return transfer if peer is None else dataclasses.replace(transfer, peer=peer)

    def dispatch_of(self, transfer: Transfer, *, streaming: bool) -> str:
        """``concurrent``, or why this request's legs run serially (the access line's
        ``push``). Callers that do not ask (warm-up) run serially: ``runs_concurrently``
        stays False, since only ``proxying.push`` bounds a decode's wait for its write."""
        if self.dispatch == "serial":
            return "serial"
        if not streaming:
            # A concurrent decode's wait is bounded by its first streamed byte once P
            # answered; a whole answer has no such moment.
            return "serial:whole-answer"
        if transfer.peer is None:
            return "serial:unknown-prefill"  # its first answer teaches the coordinates
        if self.dispatch == "auto" and not transfer.decision.decode_cached:
            # The decode holds none of the prompt: on shared cores its busy wait for the
            # write costs more than the hop it saves (docs/push.md).
            return "serial:cold-decode"
        return "concurrent"

    def prefill_body(self, original: Mapping[str, Any], transfer: Transfer) -> JSONBody:
        return prefill_body(original, PREFILL_PARAMS)

    def decode_body(
        self,
        original: Mapping[str, Any],
        transfer: Transfer,
        prefill_response: Mapping[str, Any] | None,
    ) -> JSONBody:
        if prefill_response is not None:  # serial: P's answer is a whole D leg
            params = prefill_response.get(KV_TRANSFER_PARAMS)
            if isinstance(params, dict) and not self._trusted(transfer.decision, params):
                # vLLM's push decode has no guard for bad params (a missing key is a KeyError
                # in its scheduler: the engine dies), and one sent to another prefill's side
                # registers where nothing will write: the decode recomputes instead.
                logger.warning(
                    "prefill for %s answered push params a decode cannot take; it recomputes",
                    transfer.request_id,
                )
                return decode_body(original, None)
            return super().decode_body(original, transfer, prefill_response)
        peer = transfer.peer
        if not isinstance(peer, PushCoordinates):  # dispatch_of said serial: never sent
            raise RuntimeError("a concurrent push leg without the prefill's coordinates")
        params = {
            DO_REMOTE_PREFILL: True,
            DO_REMOTE_DECODE: False,
            REMOTE_ENGINE_ID: peer.engine_id,
            REMOTE_HOST: peer.host,
            REMOTE_PORT: peer.port,
            "tp_size": peer.tp_size,
            "pp_size": peer.pp_size,
            # vLLM requires it (a KeyError without); P's internal id cannot be known before
            # it answers, so its lease is not renewed by D's heartbeats: it need not be.
            "remote_request_id": transfer.request_id,
        }
        return decode_body(original, params)

    def _trusted(self, decision: PairDecision, params: dict[str, Any]) -> bool:
        """Are a serial answer's params a whole decode leg that names this prefill rank?"""
        if not _whole_leg(params):
            return False
        found = coordinates(params)
        owner = None if found is None else self.peers.owner(found)
        return owner is None or owner == (decision.prefill.url, decision.prefill_dp_rank or 0)

    def observe_prefill(self, decision: PairDecision, answer: Mapping[str, Any]) -> None:
        self.peers.learn(
            decision.prefill.url, decision.prefill_dp_rank, answer.get(KV_TRANSFER_PARAMS)
        )

    def prefill_failed(self, decision: PairDecision) -> None:
        # It may be restarting, perhaps under the same engine id (which no answer shows):
        # its next request is serial, and its answer teaches the coordinates again.
        self.peers.forget(decision.prefill.url)

    def release_leg(
        self,
        original: Mapping[str, Any],
        prefill_response: Mapping[str, Any],
        *,
        warm: bool,
    ) -> ReleaseLeg | None:
        # P frees unclaimed blocks at its lease; a registration is the only other way, and
        # a decode that registers would also wait for (and hold) them.
        return None
