"""MooncakeConnector: concurrent legs matched by ``transfer_id``.

P's bootstrap server (``/query``, port 8998 by default) lists its engine id per DP rank; a
prefill is routable only once that is known. The decode names P's bootstrap address and
the engine id of the rank P was sent to. The legs run together, so a failed leg re-runs
the pair with a fresh transfer id.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdproxy.connectors import SerialConnector, Transfer
from pdproxy.types import EngineAddress, PairDecision
from pdproxy.wire.kv_params import (
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    REMOTE_ENGINE_ID,
    TRANSFER_ID,
)
from pdproxy.wire.shaping import JSONBody, client_request_id, decode_body, prefill_body

BOOTSTRAP_PATH = "/query"


class MooncakeConnector(SerialConnector):
    def begin(self, decision: PairDecision, client_request_id_: str | None) -> Transfer:
        request_id = client_request_id(client_request_id_)
        return Transfer(decision, request_id, f"xfer-{request_id}")

    def runs_concurrently(self, transfer: Transfer) -> bool:
        return True

    def decode_retry_reuses_prefill(self, transfer: Transfer, reason: str) -> bool:
        return False

    def prefill_body(self, original: Mapping[str, Any], transfer: Transfer) -> JSONBody:
        params = {
            DO_REMOTE_DECODE: True,
            DO_REMOTE_PREFILL: False,
            TRANSFER_ID: transfer.transfer_id,
        }
        return prefill_body(original, params)

    def decode_body(
        self,
        original: Mapping[str, Any],
        transfer: Transfer,
        prefill_response: Mapping[str, Any] | None,
    ) -> JSONBody:
        prefill = transfer.decision.prefill
        rank = transfer.decision.prefill_dp_rank or 0
        params = {
            DO_REMOTE_DECODE: False,
            DO_REMOTE_PREFILL: True,
            "remote_bootstrap_addr": prefill.address.bootstrap_url,
            REMOTE_ENGINE_ID: prefill.engine_ids[rank] if rank < len(prefill.engine_ids) else None,
            TRANSFER_ID: transfer.transfer_id,
        }
        return decode_body(original, params)

    def prefill_bootstrap_url(self, address: EngineAddress) -> str | None:
        if address.bootstrap_url is None:
            return None
        return address.bootstrap_url + BOOTSTRAP_PATH

    def parse_bootstrap(self, answer: Any) -> tuple[str, ...]:
        """``{dp_rank: {"engine_id": str, "worker_addr": ...}}`` → engine ids in rank order."""
        if not isinstance(answer, dict) or not answer:
            raise ValueError("bootstrap /query answered no ranks")
        try:
            ranks = sorted((int(rank), info["engine_id"]) for rank, info in answer.items())
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError("bootstrap /query answer is malformed") from exc
        if [rank for rank, _ in ranks] != list(range(len(ranks))):
            raise ValueError("bootstrap /query ranks are not 0..n-1")
        if not all(isinstance(engine_id, str) for _, engine_id in ranks):
            raise ValueError("bootstrap /query engine ids must be strings")
        return tuple(engine_id for _, engine_id in ranks)
