"""One request's run through the orchestrator: its retry state, the decode it holds while
its prefill runs, and a retry's decision."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from pdproxy.connectors import Transfer
from pdproxy.observability.request_context import bind_request_id
from pdproxy.proxying.leg_counts import reserve, unreserve
from pdproxy.proxying.retries import RetryRun
from pdproxy.types import Endpoint, PairDecision, Role

logger = logging.getLogger("pdproxy.proxying.orchestrator")  # its lines, as before


@dataclass(slots=True)
class Run(RetryRun):
    """One request's retry state, and the decode it holds while its prefill runs."""

    reserved: Endpoint | None = None  # the decode waiting on this request's prefill
    avoid: frozenset[str] = frozenset()  # decodes a migrated stream was cut on

    def reserve(self, decode: Endpoint) -> None:
        """Count the request on its decode while the prefill runs: a burst must not herd
        onto the decode that looked idle because none of its legs had started yet."""
        if decode is not self.reserved:
            self.unreserve()
            reserve(decode)
            self.reserved = decode

    def unreserve(self) -> None:
        decode = self.reserved
        if decode is not None:
            unreserve(decode)
            self.reserved = None


def replaced(
    decision: PairDecision, role: Role, chosen: Endpoint, rank: int | None
) -> PairDecision:
    """``decision`` with ``chosen`` (on DP rank ``rank``) as its instance of ``role``."""
    # The prediction was for the instance replaced: none for its successor (the self-check
    # must not compare another engine's hit with it).
    if role is Role.PREFILL:
        return dataclasses.replace(
            decision, prefill=chosen, prefill_dp_rank=rank, prefill_cached=None
        )
    return dataclasses.replace(decision, decode=chosen, decode_dp_rank=rank, decode_cached=None)


def log_decision(transfer: Transfer, why: str) -> None:
    bind_request_id(transfer.request_id)  # the connector fixed it: log lines carry it
    if logger.isEnabledFor(logging.DEBUG):
        decision = transfer.decision
        logger.debug(
            "%s: %s to prefill %s (dp rank %s), decode %s",
            transfer.request_id,
            why,
            decision.prefill.url,
            decision.prefill_dp_rank,
            decision.decode.url,
        )
