"""Released KV instead of stranded KV: when a prefill computed KV that no decode will read,
free it on the engines at once instead of leaving it pinned until the connector's lease
(NIXL: 30 s) runs out.

The connector says how (``KVConnector.release_leg``): a short decode leg that makes a decode
engine release the blocks, cheaper when that decode already reads from the same source
(``Endpoint.kv_sources``). It is sent in the background to a routable decode (never the one
that failed), its answer read and checked, and it never reaches a client or the request
metrics.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import orjson

from pdproxy.connectors import KVConnector, ReleaseLeg, Transfer
from pdproxy.errors import ProxyError
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.proxying.exchange import ClientRequest
from pdproxy.proxying.leg_counts import forget_kv_source
from pdproxy.resilience.outlier import OutlierDetector
from pdproxy.types import Endpoint
from pdproxy.upstream.engine_client import EngineClient
from pdproxy.wire.shaping import leg_headers

logger = logging.getLogger(__name__)

_RELEASE_WITHIN = 30.0  # seconds; past the lease there is nothing left to release


class KVRelease:
    def __init__(
        self,
        *,
        connector: KVConnector,
        client: EngineClient,
        registry: EndpointRegistry,
        outliers: OutlierDetector,
        metrics: ProxyMetrics,
    ) -> None:
        self._connector = connector
        self._client = client
        self._registry = registry
        self._outliers = outliers
        self._metrics = metrics
        self._tasks: set[asyncio.Task[None]] = set()

    def orphaned(
        self,
        request: ClientRequest,
        transfer: Transfer,
        answer: Mapping[str, Any],
        *,
        failed: Endpoint | None,
    ) -> None:
        """No decode will read ``answer``'s KV; ``failed`` is a decode not to ask."""
        source = self._connector.kv_source(answer)
        decode = self._choose(source, failed)
        warm = decode is not None and source is not None and source in decode.legs.kv_sources
        leg = self._connector.release_leg(request.body, answer, warm=warm)
        if leg is None:
            self._metrics.released_kv.labels("not_needed").inc()
            return
        if decode is None:
            self._metrics.released_kv.labels("no_decode").inc()
            return
        task = asyncio.create_task(self._send(request, transfer, decode, leg, source))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _choose(self, source: str | None, failed: Endpoint | None) -> Endpoint | None:
        """A routable decode, not ``failed``; one that reads from ``source`` if any does."""
        decodes = [e for e in self._registry.snapshot().decode if e is not failed]
        available = [e for e in decodes if self._outliers.available(e)] or decodes
        warm = [e for e in available if source is not None and source in e.legs.kv_sources]
        chosen = warm or available
        return chosen[0] if chosen else None

    async def _send(
        self,
        request: ClientRequest,
        transfer: Transfer,
        decode: Endpoint,
        leg: ReleaseLeg,
        source: str | None,
    ) -> None:
        headers = leg_headers(
            transfer.request_id + "-release", request.authorization, via=request.via
        )
        try:
            upstream, _ = await self._client.post_read(
                decode.url + leg.path,
                orjson.dumps(leg.body),
                headers,
                leg="release",
                within=_RELEASE_WITHIN,
            )
            status: int | None = upstream.status
        except (ProxyError, ValueError) as exc:  # ValueError: a header it cannot carry
            logger.info(
                "could not release KV of %s via %s: %s", transfer.request_id, decode.url, exc
            )
            status = None
        released = status == leg.expect
        self._metrics.released_kv.labels("released" if released else "failed").inc()
        if not released and source is not None:
            forget_kv_source(decode, source)  # it did not act as a warm decode would
        logger.debug(
            "KV of %s: release via %s answered %s", transfer.request_id, decode.url, status
        )
