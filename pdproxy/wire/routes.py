"""The endpoints pdproxy relays whole to one instance, and how a Responses API
conversation stays on the instance that holds it. Pure: no I/O.

Only ``/v1/completions``, ``/v1/chat/completions`` and the token-in
``/inference/v1/generate`` go through prefill and decode. The
rest of vLLM's surface that pdproxy serves goes to ONE decode instance (``Passthrough``),
the body and status as they came:

* ``/tokenize``, ``/detokenize``, ``GET /version``: the model's tokenizer or the engine
  itself; nothing is computed, so one instance is all it takes.
* ``/v1/embeddings``, ``/pooling``, ``/score`` (``/v1/score``), ``/rerank`` (``/v1/rerank``,
  ``/v2/rerank``): pooling models run one forward pass over the prompt and have no decode
  phase, so there is no KV to hand over.
* ``/v1/completions/render``, ``/v1/chat/completions/render``: vLLM's render step
  (``--enable-scale-out``) turns a text request into token ids and sampling params for
  ``/inference/v1/generate``; it runs the tokenizer and chat template only, no model.
* ``/v1/responses``: generation, but stateful in vLLM. With ``store: true`` (the default)
  and ``VLLM_ENABLE_RESPONSES_API_STORE=1``, the instance that served a response keeps it,
  and its conversation, in its own memory; a later request naming it in
  ``previous_response_id`` is answered 404 by every other instance.

So pdproxy names each new response itself: vLLM takes the body's ``request_id`` as the
response id, and pdproxy sets it (when the client did not) to ``resp_`` + the serving
instance's pin (8 hex of a stable hash of its URL) + 24 random hex. A request whose
``previous_response_id`` carries the pin of a routable instance goes to that instance,
whatever the policy, and its own response is pinned there too, so a whole conversation
stays on one instance, and every pdproxy replica routes it the same way without keeping
any state. A previous response whose instance is gone (or that pdproxy did not name) is
routed by the policy; the engine then answers its own 404, as vLLM does after a restart.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pdproxy.types import Endpoint
from pdproxy.wire.kv_params import KV_TRANSFER_PARAMS
from pdproxy.wire.shaping import REQUEST_ID, JSONBody

PREVIOUS_RESPONSE_ID = "previous_response_id"
RESPONSE_ID_PREFIX = "resp_"
_PIN_HEX = 8
_RANDOM_HEX = 24
RESPONSES = "/v1/responses"


@dataclass(frozen=True, slots=True)
class PassthroughRoute:
    """One endpoint relayed to a single instance."""

    path: str
    method: Literal["GET", "POST"] = "POST"

    @property
    def responses(self) -> bool:
        """The Responses API: it may stream, it generates, and it is pinned."""
        return self.path == RESPONSES


TOKENIZE = PassthroughRoute("/tokenize")
ROUTES: tuple[PassthroughRoute, ...] = (
    TOKENIZE,
    PassthroughRoute("/detokenize"),
    PassthroughRoute("/v1/completions/render"),
    PassthroughRoute("/v1/chat/completions/render"),
    PassthroughRoute("/v1/embeddings"),
    PassthroughRoute("/pooling"),
    PassthroughRoute("/score"),
    PassthroughRoute("/v1/score"),
    PassthroughRoute("/rerank"),
    PassthroughRoute("/v1/rerank"),
    PassthroughRoute("/v2/rerank"),
    PassthroughRoute(RESPONSES),
    PassthroughRoute("/version", "GET"),
)


def pin(url: str) -> str:
    """An instance's pin: the same on every pdproxy replica, for as long as its URL."""
    return hashlib.blake2b(url.encode(), digest_size=_PIN_HEX // 2).hexdigest()


def new_response_id(url: str) -> str:
    """A response id pinned to the instance at ``url`` (vLLM's own are ``resp_`` + hex)."""
    return RESPONSE_ID_PREFIX + pin(url) + uuid.uuid4().hex[:_RANDOM_HEX]


def pinned(response_id: Any, endpoints: Iterable[Endpoint]) -> Endpoint | None:
    """The instance among ``endpoints`` whose pin ``response_id`` carries, if any."""
    if not isinstance(response_id, str) or not response_id.startswith(RESPONSE_ID_PREFIX):
        return None
    start = len(RESPONSE_ID_PREFIX)
    wanted = response_id[start : start + _PIN_HEX]
    if len(wanted) < _PIN_HEX:
        return None
    return next((e for e in endpoints if pin(e.url) == wanted), None)


def responses_body(original: Mapping[str, Any], url: str) -> JSONBody:
    """A ``/v1/responses`` body for the instance at ``url``: named with a response id pinned
    there unless the client named it, and without a client's ``kv_transfer_params`` (as
    the generation endpoints: it would let a client point an engine at any host's KV)."""
    body = {k: v for k, v in original.items() if k != KV_TRANSFER_PARAMS}
    if REQUEST_ID not in original:
        body[REQUEST_ID] = new_response_id(url)
    return body
