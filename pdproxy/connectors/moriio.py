"""MoRIIOConnector (vLLM >= 2026), READ (pull, serial) or WRITE (push, concurrent).

Both legs carry the request id that embeds both peers' ``zmq_address``
(``host:IP,handshake:PORT,notify:PORT``) and one shared ``transfer_id``; a decode without
the prefill's ``transfer_id`` can never match it. With several DP ranks on P, the chosen
rank goes to P as ``X-data-parallel-rank`` (added by the orchestrator) and to D as
``remote_dp_rank``, or the notify lands on rank 0. A failed READ decode that never reached
its engine is retried on another decode with the same transfer (P still holds the blocks);
a WRITE transfer was pushed to the failed decode, so the pair is re-run.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from pdproxy.config.proxy import ProxyConfig
from pdproxy.connectors import SerialConnector, Transfer
from pdproxy.types import PairDecision
from pdproxy.wire.kv_params import (
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    KV_TRANSFER_PARAMS,
    REMOTE_BLOCK_IDS,
    REMOTE_ENGINE_ID,
    TRANSFER_ID,
)
from pdproxy.wire.shaping import (
    JSONBody,
    decode_body,
    peer_request_id,
    prefill_body,
)

TRANSFER_PREFIX = "tx"  # MoRIIOConstants.TRANSFER_PREFIX
# What a READ decode takes from P's answer; the rest it builds from the request id.
_FROM_PREFILL = (REMOTE_ENGINE_ID, REMOTE_BLOCK_IDS, TRANSFER_ID)


class MoriioConnector(SerialConnector):
    def __init__(self, default_mode: str | None) -> None:
        self._default_mode = default_mode

    @classmethod
    def from_config(cls, config: ProxyConfig) -> MoriioConnector:
        return cls(config.transfer_mode)

    def begin(self, decision: PairDecision, client_request_id_: str | None) -> Transfer:
        request_id = peer_request_id(decision.prefill.kv_address, decision.decode.kv_address)
        return Transfer(decision, request_id, f"{TRANSFER_PREFIX}-{uuid.uuid4()}")

    def runs_concurrently(self, transfer: Transfer) -> bool:
        mode = transfer.decision.prefill.address.transfer_mode or self._default_mode
        return mode == "WRITE"

    def decode_retry_reuses_prefill(self, transfer: Transfer, reason: str) -> bool:
        if self.runs_concurrently(transfer):
            return False
        return super().decode_retry_reuses_prefill(transfer, reason)

    def prefill_body(self, original: Mapping[str, Any], transfer: Transfer) -> JSONBody:
        decode = transfer.decision.decode
        params = {
            DO_REMOTE_DECODE: True,
            DO_REMOTE_PREFILL: False,
            REMOTE_ENGINE_ID: None,
            REMOTE_BLOCK_IDS: None,
            TRANSFER_ID: transfer.transfer_id,
            "remote_dp_size": decode.dp_size,
            "remote_tp_size": decode.address.tp_size,
        }
        return prefill_body(original, params)

    def decode_body(
        self,
        original: Mapping[str, Any],
        transfer: Transfer,
        prefill_response: Mapping[str, Any] | None,
    ) -> JSONBody:
        prefill = transfer.decision.prefill
        params: dict[str, Any] = {
            DO_REMOTE_DECODE: False,
            DO_REMOTE_PREFILL: True,
            REMOTE_ENGINE_ID: None,
            REMOTE_BLOCK_IDS: None,
            TRANSFER_ID: transfer.transfer_id,
            "remote_dp_size": prefill.dp_size,
            "remote_tp_size": prefill.address.tp_size,
        }
        if transfer.decision.prefill_dp_rank is not None:
            params["remote_dp_rank"] = transfer.decision.prefill_dp_rank
        returned = prefill_response.get(KV_TRANSFER_PARAMS) if prefill_response else None
        if isinstance(returned, dict):
            params.update({k: returned[k] for k in _FROM_PREFILL if k in returned})
        return decode_body(original, params)
