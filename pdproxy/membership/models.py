"""What each instance serves, kept true: ``GET /v1/models`` re-read on a timer and after a
LoRA adapter is loaded or unloaded through pdproxy.

An instance's models (its base models and LoRA adapters) decide which requests it may
take (``pdproxy.fleet.models``). Registered and admin-added instances are read before they
are routable (``InstanceChecks``); this reader keeps every instance's list current after
that, static ones included (their first read is the first round, so until then they take
any model, as before). A read that fails or answers another shape leaves the list as it
was: an unreachable instance is the health checks' business, not this reader's. A list
that changed rebuilds the registry's pools.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from pdproxy.errors import UpstreamError
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.membership.identity import reidentify
from pdproxy.membership.instance_checks import served_models
from pdproxy.types import Endpoint
from pdproxy.upstream.engine_client import EngineClient

logger = logging.getLogger(__name__)


class ModelReader:
    def __init__(
        self,
        *,
        interval: float,
        registry: EndpointRegistry,
        client: EngineClient,
        max_models: int = 1024,
    ) -> None:
        self.interval = interval  # seconds between rounds; 0: no timer
        self._max_models = max_models  # a longer list is ignored (the old one stays)
        self._registry = registry
        self._client = client
        self._task: asyncio.Task[None] | None = None

    async def settle(self, timeout: float) -> None:
        """The first round, at start-up, within ``timeout`` seconds: the static instances'
        models are known before the first request (an instance that does not answer in
        time takes any model until the next round)."""
        if self.interval > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.read_all(), timeout)

    def start(self) -> None:
        if self.interval > 0:
            self._task = asyncio.create_task(self._run())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def read_all(self) -> None:
        await asyncio.gather(*(self.read(e) for e in self._registry.all()))

    async def read(self, endpoint: Endpoint) -> bool:
        """Re-read one instance's ``/v1/models``; True when its list changed. Never raises
        for the engine's fault."""
        before = endpoint.identity  # a LoRA load or unload meanwhile makes a new one
        try:
            answer: Any = await self._client.get_json(endpoint.url + "/v1/models")
        except (UpstreamError, ValueError):
            return False
        models = served_models(answer, self._max_models)
        if models is None or models == endpoint.models:
            return False
        if self._registry.get(endpoint.url) is not endpoint or endpoint.identity is not before:
            return False  # replaced, removed or re-identified meanwhile: this answer is stale
        # A change is news; the first list of an instance admitted without one is not.
        level = logging.INFO if endpoint.models else logging.DEBUG
        logger.log(level, "%s %s serves %s", endpoint.role.value, endpoint.url, list(models))
        reidentify(endpoint, models=models)
        self._registry.invalidate()
        return True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)  # (the first round is ``settle``'s)
            try:
                await self.read_all()
            except Exception:  # the reader must outlive any one bad answer
                logger.exception("models round failed")
