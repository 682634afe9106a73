"""vLLM's runtime LoRA API on one instance: ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (the engine needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` and
``--enable-lora``).

Used by pdproxy's own ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, which
fan a client's call out to every routable instance, and by ``--lora-load-on-demand``,
which loads an adapter on the pair chosen for a request when no pair holds it. An
instance that loaded or unloaded an adapter is re-identified at once by the membership
(``relabel``: ``membership.identity.relabel``, wired by ``pdproxy.build``; its models decide
the pools it is in); the ``/v1/models`` re-read confirms it later.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import orjson

from pdproxy.errors import UpstreamStatusError
from pdproxy.types import Endpoint
from pdproxy.upstream.engine_client import EngineClient

logger = logging.getLogger(__name__)

LOAD = "/v1/load_lora_adapter"
UNLOAD = "/v1/unload_lora_adapter"
LEG = "lora"


@dataclass(frozen=True, slots=True)
class LoraAnswer:
    """One instance's answer: its status, content type and body, as it came."""

    status: int
    content_type: str
    body: bytes

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


@dataclass(slots=True)
class LoraCounts:
    """Adapters loaded and unloaded through pdproxy (on demand or by a client)."""

    loads: int = 0
    unloads: int = 0
    evictions: int = 0  # unloads --max-loras made to free a slot (counted in unloads too)
    by_adapter: dict[str, int] = field(default_factory=dict)  # loads per adapter


class LoraClient:
    def __init__(
        self, *, relabel: Callable[[Endpoint, tuple[str, ...]], None], client: EngineClient
    ) -> None:
        self._relabel = relabel  # the membership re-identifies: this client writes no identity
        self._client = client
        self.counts = LoraCounts()

    async def call(
        self, endpoint: Endpoint, path: str, body: bytes, headers: Mapping[str, str]
    ) -> LoraAnswer:
        """``path`` (``LOAD`` or ``UNLOAD``) on ``endpoint``; raises ``UpstreamError`` when
        it cannot be reached. A 2xx re-identifies the instance with the adapter added or
        removed."""
        upstream, data = await self._client.post_read(endpoint.url + path, body, headers, leg=LEG)
        answer = LoraAnswer(upstream.status, upstream.content_type, data)
        if answer.ok:
            self._changed(endpoint, path, body)
        return answer

    async def load(
        self, endpoint: Endpoint, name: str, path: str, headers: Mapping[str, str]
    ) -> None:
        """Load adapter ``name`` from ``path`` on ``endpoint``; raises ``UpstreamError``
        (``UpstreamStatusError`` with the engine's answer when it refused)."""
        body = orjson.dumps({"lora_name": name, "lora_path": path})
        answer = await self.call(endpoint, LOAD, body, headers)
        if not answer.ok:
            raise UpstreamStatusError(
                leg=LEG, status=answer.status, body=answer.body, content_type=answer.content_type
            )

    def _changed(self, endpoint: Endpoint, path: str, body: bytes) -> None:
        try:
            name = orjson.loads(body).get("lora_name")
        except (orjson.JSONDecodeError, AttributeError):
            return
        if not isinstance(name, str) or not endpoint.models:
            return  # its models are not known yet: the /v1/models re-read tells
        models = tuple(m for m in endpoint.models if m != name)
        if path == LOAD:
            models += (name,)
            self.counts.loads += 1
            self.counts.by_adapter[name] = self.counts.by_adapter.get(name, 0) + 1
        else:
            self.counts.unloads += 1
        logger.info("%s %s on %s", "loaded" if path == LOAD else "unloaded", name, endpoint.url)
        self._relabel(endpoint, models)
