"""Pre-warmed pairs: one tiny PD request through a new instance and a few peers before the
instance is routable (``--warm-pairs``, ``--warm-timeout-secs``).

A connector pays a handshake the first time a decode meets a prefill: a NIXL decode fetches
the prefill's agent metadata over the side channel and adds the remote agent before it reads
a block. On the real CPU tier that made the first request through a new pair 2.6x to 9x
slower to its first token than the next ones (docs/real-engines.md, "Pre-warmed pairs"). Membership
awaits ``PairWarmer.warm`` after an instance's admission checks and before it marks it
routable, so no client request pays it.

Bounded for large fleets: a new instance warms against at most ``warm_pairs`` peers of the
other role (routable ones first), all at once, within ``warm_timeout`` seconds in all; a pair
that fails or times out is logged and the instance becomes routable anyway. A pair is warmed
once (both of its instances may ask at the same moment: the second awaits the first's run);
an instance that is admitted again (a restarted engine at the same URL) warms afresh.

The warm-up goes straight to the engines over the engine client: no orchestrator, no legs, so
it never shows in the client request metrics, the access log or the in-flight counts. Its
request id starts with ``pdproxy-warmup-`` in the engines' own logs.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

import orjson

from pdproxy.config.resilience import HealthConfig
from pdproxy.connectors import KVConnector
from pdproxy.errors import UpstreamError
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.types import Endpoint, EndpointState, PairDecision, Role
from pdproxy.upstream.engine_client import EngineClient
from pdproxy.wire.shaping import leg_headers

logger = logging.getLogger(__name__)

WARMUP_ID_PREFIX = "pdproxy-warmup-"
# longer than one KV block (16 to 128 tokens in vLLM): a transfer of whole blocks, as clients'
WARMUP_PROMPT = "pdproxy warms this prefill and decode pair. " * 24
_PATH = "/v1/completions"

Pair = tuple[str, str]  # (prefill url, decode url)


class WarmupError(Exception):
    """One pair's warm-up did not succeed (an engine refused it or sent no JSON)."""


class PairWarmer:
    def __init__(
        self,
        config: HealthConfig,
        *,
        registry: EndpointRegistry,
        client: EngineClient,
        connector: KVConnector,
        model: str | None,
        via: str | None = None,  # this pdproxy's hop marker (pdproxy.wire.hop.Hop)
    ) -> None:
        self._via = via
        self._peers = config.warm_pairs
        self._timeout = config.warm_timeout
        self._registry = registry
        self._client = client
        self._connector = connector
        self._model = model
        self._runs: dict[Pair, asyncio.Task[None]] = {}  # started or done; done ones succeeded
        registry.on_removal(self.forget)  # a departed instance's pairs are not kept

    @property
    def enabled(self) -> bool:
        return self._peers > 0

    def forget(self, url: str) -> None:
        """``url`` left or (re)joins the fleet: its pairs must be warmed again."""
        for pair in [p for p in self._runs if url in p]:
            del self._runs[pair]

    async def warm(self, endpoint: Endpoint) -> None:
        """Warm ``endpoint`` with up to ``warm_pairs`` peers; never raises, never takes more
        than ``warm_timeout`` seconds."""
        pairs = [self._pair(endpoint, peer) for peer in self._chosen_peers(endpoint)]
        if not pairs:
            return
        runs = [self._run_for(pair) for pair in pairs]
        started = time.perf_counter()
        done, pending = await asyncio.wait(runs, timeout=self._timeout)
        warmed = sum(1 for task in done if not task.cancelled() and task.exception() is None)
        logger.info(
            "warmed %s %s with %d of %d peers in %.0f ms%s",
            endpoint.role.value,
            endpoint.url,
            warmed,
            len(pairs),
            1000 * (time.perf_counter() - started),
            f" ({len(pending)} timed out)" if pending else "",
        )

    def _chosen_peers(self, endpoint: Endpoint) -> list[Endpoint]:
        other = Role.DECODE if endpoint.role is Role.PREFILL else Role.PREFILL
        peers = [
            e
            for e in self._registry.all()
            if e.role is other and e.state is not EndpointState.DRAINING
        ]
        peers.sort(key=lambda e: not e.routable)  # routable peers first, stable otherwise
        return peers[: self._peers]

    @staticmethod
    def _pair(endpoint: Endpoint, peer: Endpoint) -> tuple[Endpoint, Endpoint]:
        return (endpoint, peer) if endpoint.role is Role.PREFILL else (peer, endpoint)

    def _run_for(self, pair: tuple[Endpoint, Endpoint]) -> asyncio.Task[None]:
        key = (pair[0].url, pair[1].url)
        task = self._runs.get(key)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = asyncio.create_task(self._warm_pair(*pair))
            task.add_done_callback(_retrieve)
            self._runs[key] = task
        return task

    async def aclose(self) -> None:
        running = [t for t in self._runs.values() if not t.done()]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    async def _warm_pair(self, prefill: Endpoint, decode: Endpoint) -> None:
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self._timeout):
                await self._request(prefill, decode)
        except (UpstreamError, WarmupError, TimeoutError, ValueError) as exc:
            logger.warning("warm-up of pair %s -> %s failed: %r", prefill.url, decode.url, exc)
            raise
        logger.debug(
            "warmed pair %s -> %s in %.0f ms",
            prefill.url,
            decode.url,
            1000 * (time.perf_counter() - started),
        )

    async def _request(self, prefill: Endpoint, decode: Endpoint) -> None:
        """One tiny PD request, shaped by the connector like a client's."""
        original = {
            "model": self._model or await self._served_model(decode),
            "prompt": WARMUP_PROMPT,
            "max_tokens": 1,
            "temperature": 0,
            "stream": False,
        }
        connector = self._connector
        transfer = connector.begin(
            PairDecision(prefill, decode), WARMUP_ID_PREFIX + uuid.uuid4().hex
        )
        headers = leg_headers(transfer.request_id, None, via=self._via)
        prefill_body = connector.prefill_body(original, transfer)
        if connector.runs_concurrently(transfer):
            decode_body = connector.decode_body(original, transfer, None)
            await asyncio.gather(
                self._post(prefill, prefill_body, headers, "prefill"),
                self._post(decode, decode_body, headers, "decode"),
            )
            return
        answer = await self._post(prefill, prefill_body, headers, "prefill")
        connector.observe_prefill(transfer.decision, answer)  # nixl-push: its coordinates
        await self._post(
            decode, connector.decode_body(original, transfer, answer), headers, "decode"
        )

    async def _post(
        self, endpoint: Endpoint, body: Mapping[str, Any], headers: dict[str, str], leg: str
    ) -> dict[str, Any]:
        upstream, data = await self._client.post_read(
            endpoint.url + _PATH, orjson.dumps(body), headers, leg=leg, within=self._timeout
        )
        if upstream.status != 200:
            raise WarmupError(f"{leg} {endpoint.url} answered {upstream.status}: {data[:200]!r}")
        answer = orjson.loads(data)
        if not isinstance(answer, dict):
            raise WarmupError(f"{leg} {endpoint.url} answered no JSON object")
        return answer

    async def _served_model(self, endpoint: Endpoint) -> str:
        if endpoint.models:
            return endpoint.models[0]
        answer: Any = await self._client.get_json(endpoint.url + "/v1/models")
        models = answer.get("data") if isinstance(answer, dict) else None
        if not models or not isinstance(models[0], dict) or "id" not in models[0]:
            raise WarmupError(f"{endpoint.url} lists no model")
        return str(models[0]["id"])


def _retrieve(task: asyncio.Task[None]) -> None:
    """A run that outlived its ``warm`` call (timed out) was already logged."""
    if not task.cancelled():
        task.exception()
