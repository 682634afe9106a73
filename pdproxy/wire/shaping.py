"""Pure OpenAI-body transforms. They never mutate their input.

Both legs are built from the client's *untouched* original body, so a leg can be rebuilt
(or a later fallback can send the original) without undoing earlier edits.

Two body shapes exist. The OpenAI text endpoints carry the limits top-level
(``max_tokens``, ``min_tokens``). vLLM's token-in ``/inference/v1/generate`` carries them in
its ``sampling_params`` object, beside ``token_ids``; ``stream``, ``stream_options`` and
``kv_transfer_params`` stay top-level there too. The shape is told from the body itself
(``is_token_in``), so the connectors, which see only bodies, shape both alike.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from typing import Any

from pdproxy.types import ApiKind
from pdproxy.wire.coerce import read_bool
from pdproxy.wire.kv_params import KV_TRANSFER_PARAMS

MODEL = "model"
PROMPT = "prompt"
MESSAGES = "messages"
STREAM = "stream"
STREAM_OPTIONS = "stream_options"
MAX_TOKENS = "max_tokens"
MAX_COMPLETION_TOKENS = "max_completion_tokens"
MIN_TOKENS = "min_tokens"
MIN_COMPLETION_TOKENS = "min_completion_tokens"
TOKEN_IDS = "token_ids"
SAMPLING_PARAMS = "sampling_params"
# a Responses request's id, and the id generate's answer and chunks carry
REQUEST_ID = "request_id"

HEADER_REQUEST_ID = "X-Request-Id"
# The same header as ASGI names it (lower-case): read from a client's request, written on
# pdproxy's answer.
REQUEST_ID_KEY = HEADER_REQUEST_ID.lower()
HEADER_DP_RANK = "X-data-parallel-rank"
HEADER_AUTHORIZATION = "Authorization"
HEADER_VIA = "Via"  # the hop markers a leg carries (pdproxy.wire.hop.Hop)

# Fields a one-token leg must not carry: it never streams, and vLLM rejects
# min_tokens > max_tokens. A prefill leg never carries the client's own KV params either.
_ONE_TOKEN_DROPPED = frozenset({STREAM_OPTIONS, MIN_TOKENS, MIN_COMPLETION_TOKENS})
_PREFILL_DROPPED = _ONE_TOKEN_DROPPED | {KV_TRANSFER_PARAMS}

# A client may name its request, but only with characters that are safe inside vLLM's
# internal ids and log lines.
_SANE_REQUEST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")

JSONBody = dict[str, Any]


def is_token_in(body: Mapping[str, Any]) -> bool:
    """A ``/inference/v1/generate`` body: token ids with a ``sampling_params`` object (the
    text endpoints have neither)."""
    return TOKEN_IDS in body and isinstance(body.get(SAMPLING_PARAMS), Mapping)


def body_kind(body: Mapping[str, Any]) -> ApiKind:
    """The endpoint a generation body is for, from its shape."""
    if is_token_in(body):
        return ApiKind.GENERATE
    return ApiKind.CHAT if MESSAGES in body else ApiKind.COMPLETIONS


def one_token(body: Mapping[str, Any], dropped: frozenset[str] = _ONE_TOKEN_DROPPED) -> JSONBody:
    """``body`` clamped to one whole token: not streamed, no minimum, no stream options.
    A token-in body is clamped in its ``sampling_params``."""
    clamped = {k: v for k, v in body.items() if k not in dropped}
    if is_token_in(body):
        clamped[SAMPLING_PARAMS] = _one_token_sampling(body[SAMPLING_PARAMS])
    else:
        clamped[MAX_TOKENS] = 1
        if MAX_COMPLETION_TOKENS in body:
            clamped[MAX_COMPLETION_TOKENS] = 1
    clamped[STREAM] = False
    return clamped


def _one_token_sampling(params: Mapping[str, Any]) -> JSONBody:
    """vLLM's ``SamplingParams`` limited to one token (``min_tokens`` > ``max_tokens`` is
    rejected, so a minimum becomes 1: the one token is then sampled as the client's first,
    with EOS masked and no stop string checked, which ``--first-token-from-prefill`` sends
    on)."""
    clamped = {k: v for k, v in params.items() if k != MIN_TOKENS}
    minimum = params.get(MIN_TOKENS)
    if type(minimum) is int and minimum > 0:
        clamped[MIN_TOKENS] = 1
    clamped[MAX_TOKENS] = 1
    return clamped


def prefill_body(
    original: Mapping[str, Any], kv_transfer_params: Mapping[str, Any] | None
) -> JSONBody:
    """The prefill leg: clamped to one token, not streamed, with the connector's params."""
    body = one_token(original, _PREFILL_DROPPED)
    if kv_transfer_params is not None:
        body[KV_TRANSFER_PARAMS] = dict(kv_transfer_params)
    return body


def decode_body(
    original: Mapping[str, Any], kv_transfer_params: Mapping[str, Any] | None
) -> JSONBody:
    """The decode leg: the original request plus the connector's params.

    A client's own ``kv_transfer_params`` never reaches an engine: it would let a client
    point a decode at any host's KV.
    """
    body = {k: v for k, v in original.items() if k != KV_TRANSFER_PARAMS}
    if kv_transfer_params is not None:
        body[KV_TRANSFER_PARAMS] = kv_transfer_params
    return body


def is_streaming(body: Mapping[str, Any]) -> bool:
    """The client asked for a stream, as vLLM reads ``stream`` (``"true"``, ``1``... too)."""
    return read_bool(body.get(STREAM))


def includes_usage(body: Mapping[str, Any]) -> bool:
    """``stream_options.include_usage``, as vLLM reads it."""
    options = body.get(STREAM_OPTIONS)
    return isinstance(options, Mapping) and read_bool(options.get("include_usage"))


def client_request_id(header_value: str | None) -> str:
    """The client's ``X-Request-Id`` when it is sane, else a fresh uuid4 hex."""
    if header_value is not None and _SANE_REQUEST_ID.match(header_value):
        return header_value
    return uuid.uuid4().hex


def peer_request_id(prefill_kv_address: str, decode_kv_address: str) -> str:
    """The id P2P-NCCL, MoRIIO and Mooncake engines parse their peer's address from.

    vLLM's MoRIIO decode regex requires the trailing 32-hex uuid; both legs carry the same id.
    """
    return (
        f"___prefill_addr_{prefill_kv_address}___decode_addr_{decode_kv_address}_{uuid.uuid4().hex}"
    )


def leg_headers(
    request_id: str, authorization: str | None, dp_rank: int | None = None, via: str | None = None
) -> dict[str, str]:
    """Headers for one upstream leg; the same request id goes to both legs. ``via``: the
    request's hop markers, this pdproxy's last."""
    headers = {"Content-Type": "application/json", HEADER_REQUEST_ID: request_id}
    if authorization is not None:
        headers[HEADER_AUTHORIZATION] = authorization
    if dp_rank is not None:
        headers[HEADER_DP_RANK] = str(dp_rank)
    if via is not None:
        headers[HEADER_VIA] = via
    return headers
