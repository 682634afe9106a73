"""NixlConnector (pull): P returns ``kv_transfer_params``; D gets them verbatim.

P keeps the blocks until D pulls them or the lease (30 s by default) runs out, so the legs
are serial. Every key of P's dict is forwarded, including ones this proxy does not know
(the schema is versioned by vLLM's NIXL_CONNECTOR_VERSION).

KV that no decode will read is released through a decode (a prefill cannot be told to
free it: vLLM ignores an abort of a finished request, and its abort endpoint is off by
default). Measured on vLLM 0.32's CPU engines (docs/fault-tolerance.md):

* a decode that already reads from this prefill (warm) is sent a leg it rejects before
  admission: ``stream`` with ``use_beam_search`` is refused with 400 before the model,
  the prompt or the limits are looked at, and vLLM's rejection cleanup
  (``notify_kv_transfer_request_rejected``) tells P to free the blocks at once (0.03-0.97 s);
* a cold decode would queue that notification until its next step, after the lease, so it
  is sent a real one-token decode leg instead: it reads the KV (P frees it) and answers
  one token (0.35-0.8 s).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from pdproxy.connectors import ReleaseLeg, SerialConnector, Transfer
from pdproxy.types import ApiKind
from pdproxy.wire.kv_params import (
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    KV_TRANSFER_PARAMS,
    REMOTE_BLOCK_IDS,
    REMOTE_ENGINE_ID,
    REMOTE_HOST,
    REMOTE_PORT,
)
from pdproxy.wire.shaping import (
    MODEL,
    JSONBody,
    body_kind,
    decode_body,
    one_token,
    prefill_body,
)

logger = logging.getLogger(__name__)

_REJECTED = 400  # vLLM: "Streaming is not currently supported with beam search"

PREFILL_PARAMS: Mapping[str, Any] = {
    DO_REMOTE_DECODE: True,
    DO_REMOTE_PREFILL: False,
    REMOTE_ENGINE_ID: None,
    REMOTE_BLOCK_IDS: None,
    REMOTE_HOST: None,
    REMOTE_PORT: None,
}


class NixlConnector(SerialConnector):
    routes_decode_rank = True  # any of D's ranks pulls from P alike

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

    def kv_source(self, prefill_response: Mapping[str, Any]) -> str | None:
        params = prefill_response.get(KV_TRANSFER_PARAMS)
        engine = params.get(REMOTE_ENGINE_ID) if isinstance(params, dict) else None
        return engine if isinstance(engine, str) else None

    def release_leg(
        self,
        original: Mapping[str, Any],
        prefill_response: Mapping[str, Any],
        *,
        warm: bool,
    ) -> ReleaseLeg | None:
        params = prefill_response.get(KV_TRANSFER_PARAMS)
        if not isinstance(params, dict) or not params.get(REMOTE_BLOCK_IDS):
            return None  # nothing held on P
        if warm:
            body: JSONBody = {
                MODEL: original.get(MODEL),
                "prompt": "x",
                "max_tokens": 1,
                "stream": True,
                "use_beam_search": True,
                KV_TRANSFER_PARAMS: params,
            }
            return ReleaseLeg(ApiKind.COMPLETIONS.path, body, _REJECTED)
        return ReleaseLeg(body_kind(original).path, one_token(decode_body(original, params)), 200)
