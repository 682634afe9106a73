"""Released KV instead of stranded KV: when a prefill computed KV that no decode will read,
free it on the engines at once instead of leaving it pinned until the connector's lease
(NIXL: 30 s) runs out.

The connector says how (``KVConnector.release_body``): a body for a short decode leg that
makes a decode engine consume, and so release, the prefill's blocks. It is sent in the
background to a routable decode (not the one that failed) and never reaches a client.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import orjson

from pdproxy.connectors import KVConnector, Transfer
from pdproxy.engine_client import EngineClient
from pdproxy.errors import ProxyError
from pdproxy.exchange import ClientRequest
from pdproxy.metrics import ProxyMetrics
from pdproxy.registry import EndpointRegistry
from pdproxy.resilience.outlier import OutlierDetector
from pdproxy.shaping import leg_headers
from pdproxy.types import Endpoint

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
        self, request: ClientRequest, transfer: Transfer, answer: dict[str, Any], why: str
    ) -> None:
        """``answer``'s KV will not be read by the decode it was meant for (``why``)."""
        body = self._connector.release_body(request.body, transfer, answer)
        if body is None:
            self._metrics.released_kv.labels("not_needed").inc()
            return
        avoid = transfer.decision.decode if why != "client_disconnected" else None
        decode = self._decode(avoid)
        if decode is None:
            self._metrics.released_kv.labels("no_decode").inc()
            return
        task = asyncio.create_task(self._send(request, transfer, decode, body, why))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _decode(self, avoid: Endpoint | None) -> Endpoint | None:
        decodes = [e for e in self._registry.snapshot().decode if e is not avoid]
        available = [e for e in decodes if self._outliers.available(e)]
        chosen = available or decodes
        return chosen[0] if chosen else None

    async def _send(
        self,
        request: ClientRequest,
        transfer: Transfer,
        decode: Endpoint,
        body: dict[str, Any],
        why: str,
    ) -> None:
        headers = leg_headers(transfer.request_id, request.authorization)
        try:
            upstream, _ = await self._client.post_read(
                decode.url + request.kind.path,
                orjson.dumps(body),
                headers,
                leg="release",
                within=_RELEASE_WITHIN,
            )
        except ProxyError as exc:
            self._metrics.released_kv.labels("failed").inc()
            logger.info(
                "could not release KV of %s on %s: %s", transfer.request_id, decode.url, exc
            )
            return
        outcome = "released" if upstream.status < 300 else "failed"
        self._metrics.released_kv.labels(outcome).inc()
        logger.debug("released KV of %s (%s) via %s", transfer.request_id, why, decode.url)
