"""NixlConnector (pull): P returns ``kv_transfer_params``; D gets them verbatim.

P keeps the blocks until D pulls them or the lease (30 s by default) runs out, so the legs
are serial. Every key of P's dict is forwarded, including ones this proxy does not know
(the schema is versioned by vLLM's NIXL_CONNECTOR_VERSION).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pdproxy.connectors import SerialConnector, Transfer
from pdproxy.shaping import (
    KV_TRANSFER_PARAMS,
    JSONBody,
    decode_body,
    prefill_body,
)

logger = logging.getLogger(__name__)

PREFILL_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class NixlConnector(SerialConnector):
    def prefill_body(self, original: Mapping[str, Any], transfer: Transfer) -> JSONBody:
        return prefill_body(original, PREFILL_PARAMS)

    def decode_body(
        self,
        original: Mapping[str, Any],
        transfer: Transfer,
        prefill_response: Mapping[str, Any] | None,
    ) -> JSONBody:
        params = prefill_response.get(KV_TRANSFER_PARAMS) if prefill_response else None
        if not isinstance(params, dict):
            # vLLM's decode recomputes the prompt when it gets no params: slower, still right.
            logger.warning(
                "prefill for %s returned no kv_transfer_params; decode will recompute",
                transfer.request_id,
            )
            params = None
        return decode_body(original, params)
