"""P2pNcclConnector (removed from vLLM 0.32+, still in older fleets): serial.

The request id names both peers' ``zmq_address``; no ``kv_transfer_params``. A decode
always waits for KV with no timeout, so a decode must never follow a failed prefill: the
orchestrator's serial path guarantees it. P pushes the KV to the decode its id names, so a
failed decode is retried with a fresh pair (a new id, a new prefill).
"""

from __future__ import annotations

from pdproxy.connectors import SerialConnector, Transfer
from pdproxy.types import PairDecision
from pdproxy.wire.shaping import peer_request_id


class P2pNcclConnector(SerialConnector):
    serves_decode_alone = False  # a consumer waits for the KV its request id's producer pushes

    def begin(self, decision: PairDecision, client_request_id_: str | None) -> Transfer:
        request_id = peer_request_id(decision.prefill.kv_address, decision.decode.kv_address)
        return Transfer(decision, request_id)

    def decode_retry_reuses_prefill(self, transfer: Transfer, reason: str) -> bool:
        return False
