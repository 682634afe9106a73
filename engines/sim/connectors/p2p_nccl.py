"""P2P-NCCL-like connector (PUT_ASYNC, PROTOCOLS.md 2.1): P pushes to the D named in the id.

* P (`--role prefill`), for every request: after prefilling, push the prompt's KV to D's
  address from the request id (producer regex `___decode_addr_(.*):(\\d+)`, port + rank 0),
  keyed by the internal id without vLLM's random suffix (as with
  VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1, so both legs agree). No kv_transfer_params.
* D (`--role decode`), for every request (no kv_transfer_params gating): wait for that key
  up to `kv_wait_timeout_s` (vLLM waits forever), then decode. A timeout, or an id without
  P's address (vLLM raises), fails the request.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from engines.sim import model
from engines.sim.connectors import ids
from engines.sim.connectors.transfer import SideChannelConnector, accept_kv, wait_failed
from engines.sim.openai_api import GenRequest

log = logging.getLogger("engines.sim.p2p_nccl")


class P2pNcclConnector(SideChannelConnector):
    # decode side
    def must_fetch(self, req: GenRequest) -> bool:
        return self.cfg.role == "decode"

    async def fetch(self, req: GenRequest) -> list[bytes] | None:
        if ids.p2p_peer(req.internal_id, producer=False) is None:
            raise wait_failed(
                req,
                self.counters,
                f"Request id {req.internal_id} does not contain hostname and port",
            )
        key = ids.base_request_id(req.internal_id)
        timeout = self.cfg.kv_wait_timeout_s
        parcel = await self.mailbox.ready(key, timeout)
        if parcel is None:
            raise wait_failed(req, self.counters, f"no KV received for {key} in {timeout:g} s")
        self.mailbox.take(key)
        kv = accept_kv(req, parcel.blocks, self.counters)
        if kv is None:
            raise wait_failed(req, self.counters, f"short KV received for {key}")
        return kv

    # prefill side
    def finished(self, req: GenRequest, kv: Sequence[bytes]) -> dict[str, Any] | None:
        if self.cfg.role != "prefill":
            return None
        peer = ids.p2p_peer(req.internal_id, producer=True)
        key = ids.base_request_id(req.internal_id)
        if peer is None:
            log.warning("Request id %s does not contain hostname and port", req.internal_id)
            return None
        blocks = model.pack_blocks(kv, self.cfg.block_size)
        self.spawn_send(*peer, {"op": "put", "key": key, "blocks": blocks}, key)
        return None

    # side channel: P puts into D
    async def serve(self, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("op") != "put":
            return await super().serve(msg)
        if self.mailbox.put(str(msg.get("key")), list(msg.get("blocks") or []), {}) is None:
            return {"ok": False, "error": "no free KV blocks"}
        return {"ok": True}
