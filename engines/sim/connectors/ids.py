"""Request-id parsing with vLLM's own regexes (PROTOCOLS.md 2.1, 2.2).

The proxy sends `X-Request-Id: ___prefill_addr_{P.zmq}___decode_addr_{D.zmq}_{uuid4().hex}`.
vLLM runs these regexes on its internal id (`cmpl-<X-Request-Id>-0-<8hex>` or
`chatcmpl-<X-Request-Id>-<8hex>`), so they must tolerate that prefix and suffix.
"""

from __future__ import annotations

import re

from engines.sim.registration import parse_moriio_zmq_address

# P2pNcclConnector.parse_request_id
P2P_PRODUCER_RE = re.compile(r"___decode_addr_(.*):(\d+)")
P2P_CONSUMER_RE = re.compile(r"___prefill_addr_(.*):(\d+)___")
# moriio_common.py
PREFILL_ZMQ_RE = re.compile(r"___prefill_addr_(.+?)___decode_addr_")
DECODE_ZMQ_RE = re.compile(r"___decode_addr_(.+)_[0-9a-f]{32}(?:-.*)?$")
# nixl/utils.py get_base_request_id: the random suffix vLLM appends per engine
_RANDOM_SUFFIX_RE = re.compile(r"-[0-9a-f]{8}$")


def p2p_peer(request_id: str, *, producer: bool, rank: int = 0) -> tuple[str, int] | None:
    """The peer's (ip, port + rank) as P2P-NCCL finds it: D's for a producer, P's else."""
    pattern = P2P_PRODUCER_RE if producer else P2P_CONSUMER_RE
    match = pattern.search(request_id)
    if match is None:
        return None
    return match.group(1), int(match.group(2)) + rank


def moriio_peer(request_id: str, *, prefill: bool) -> dict[str, str] | None:
    """P's (prefill=True) or D's MoRIIO address fields {host, handshake, notify}, or None."""
    match = (PREFILL_ZMQ_RE if prefill else DECODE_ZMQ_RE).search(request_id)
    if match is None:
        return None
    try:
        return parse_moriio_zmq_address(match.group(1))
    except ValueError:
        return None


def base_request_id(internal_id: str) -> str:
    """The internal id without vLLM's random suffix (VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1)."""
    return _RANDOM_SUFFIX_RE.sub("", internal_id)
