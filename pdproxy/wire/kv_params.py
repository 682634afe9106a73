"""The names of ``kv_transfer_params`` and of its fields that more than one part of pdproxy
reads or writes, as vLLM's KV connectors spell them (NIXL, MoRIIO, Mooncake): one home, so
that a connector, the first-token path and the scheduler cannot drift apart. A field only
one connector uses stays beside it."""

from __future__ import annotations

KV_TRANSFER_PARAMS = "kv_transfer_params"  # a body's field (request and answer)

# Which side of the transfer a leg is: the prefill's leg sends (do_remote_decode), the
# decode's receives (do_remote_prefill).
DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
# Where the KV is: the prefill's engine and its blocks, as its answer names them.
REMOTE_ENGINE_ID = "remote_engine_id"
REMOTE_BLOCK_IDS = "remote_block_ids"
REMOTE_HOST = "remote_host"  # NIXL's side channel
REMOTE_PORT = "remote_port"
TRANSFER_ID = "transfer_id"  # the id both legs share (MoRIIO, Mooncake)
# What the prefill found cached of the prompt (the scheduler's and kv-events' actual figure).
REMOTE_PREFILL_CACHED_TOKENS = "remote_prefill_cached_tokens"
