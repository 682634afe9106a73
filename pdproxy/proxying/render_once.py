"""Tokenize once (``--render-once``): a text request rendered once, both legs on its
token ids, the answer in the OpenAI shape.

render (vLLM's ``/v1/completions/render`` or ``/v1/chat/completions/render``, on a
``--render`` server or else on a decode, retried like a pass-through leg) → the
``/inference/v1/generate`` body (``tokenize_once``) through the orchestrator (the same
pair choice, legs, connectors, retries and usage as any token-in request) → generate's
text answer or stream put into the OpenAI shape (``derender``). A request whose answer
needs vLLM's OpenAI post-processing takes the text path (``fallback_reason``).

The one field generate does not report is the decode's ``system_fingerprint``: it is
learned once per decode from a one-token completion (``Fingerprints``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import orjson

from pdproxy.errors import ProxyError, UpstreamProtocolError
from pdproxy.fleet.registry import EndpointRegistry
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.observability.request_context import current
from pdproxy.proxying.exchange import ClientRequest, ProxyResponse
from pdproxy.proxying.orchestrator import Orchestrator
from pdproxy.proxying.passthrough import Passthrough, PassthroughRequest
from pdproxy.proxying.resumable import TranslatedStream
from pdproxy.types import ApiKind
from pdproxy.upstream.engine_client import EngineClient
from pdproxy.wire.derender import AnswerContext, StreamTranslator, whole_answer
from pdproxy.wire.routes import PassthroughRoute
from pdproxy.wire.shaping import MODEL, includes_usage, is_streaming, leg_headers
from pdproxy.wire.tokenize_once import (
    OUTPUT_MODE,
    RENDER_PATHS,
    TEXT,
    fallback_reason,
    generate_body,
    rendered_fallback,
    rendered_request,
)

logger = logging.getLogger(__name__)

RENDERED = "rendered"
_ROUTES = {kind: PassthroughRoute(path) for kind, path in RENDER_PATHS.items()}
_PROBE_TIMEOUT = 10.0
_MAX_FINGERPRINTS = 4096
_PROBE_AGAIN_SECS = 30.0
_LEARN_WAIT = 2.0  # longest a request waits for the decodes' fingerprints before its legs


class Fingerprints:
    """Each decode's ``system_fingerprint`` (vLLM's, from its config: version, parallelism,
    config hash), asked once per decode URL with a one-token completion and kept. The
    decodes are asked before a request's legs are sent, so the probe never shares a batch
    with the request it serves; a probe that failed is asked again after a while, and until
    then the answers' fingerprint is ``null``."""

    def __init__(self, client: EngineClient, clock: Callable[[], float]) -> None:
        self._client = client
        self._clock = clock
        self._known: dict[str, str | None] = {}
        self._failed: dict[str, float] = {}  # url -> when to ask again (monotonic)
        self._asking: dict[str, asyncio.Future[str | None]] = {}

    def known(self, url: str) -> bool:
        return url in self._known or self._failed.get(url, 0.0) > self._clock()

    def get(self, url: str) -> str | None:
        return self._known.get(url)

    async def learn(
        self, urls: Iterable[str], model: str, authorization: str | None, via: str | None = None
    ) -> None:
        """Ask every decode in ``urls`` not known yet, at once, waiting at most
        ``_LEARN_WAIT`` for them (a silent one is still asked, in the background)."""
        unknown = [url for url in urls if not self.known(url)]
        if unknown:
            asking = [asyncio.ensure_future(self.of(u, model, authorization, via)) for u in unknown]
            _, pending = await asyncio.wait(asking, timeout=_LEARN_WAIT)
            for waiter in pending:
                waiter.cancel()  # the waiter only: the shielded probe goes on

    async def aclose(self) -> None:
        probes = list(self._asking.values())
        for probe in probes:
            probe.cancel()
        await asyncio.gather(*probes, return_exceptions=True)

    async def of(
        self, url: str, model: str, authorization: str | None, via: str | None = None
    ) -> str | None:
        if self.known(url):
            return self._known.get(url)
        asking = self._asking.get(url)
        if asking is None:
            asking = asyncio.ensure_future(self._ask(url, model, authorization, via))
            self._asking[url] = asking
            asking.add_done_callback(lambda _: self._asking.pop(url, None))
        return await asyncio.shield(asking)

    async def _ask(
        self, url: str, model: str, authorization: str | None, via: str | None
    ) -> str | None:
        body = {MODEL: model, "prompt": [0], "max_tokens": 1, "temperature": 0}
        headers = leg_headers(f"fingerprint-{uuid.uuid4().hex}", authorization, via=via)
        try:
            upstream, data = await self._client.post_read(
                url + ApiKind.COMPLETIONS.path,
                orjson.dumps(body),
                headers,
                leg="decode",
                within=_PROBE_TIMEOUT,
            )
            answer = orjson.loads(data) if upstream.status < 300 else upstream.status
        except (ProxyError, ValueError) as error:  # not JSON, or a request not buildable
            answer = error
        if not isinstance(answer, dict):
            logger.warning("no system_fingerprint from %s: %s", url, answer)
            self._failed[url] = self._clock() + _PROBE_AGAIN_SECS
            return None
        fingerprint = answer.get("system_fingerprint")
        if len(self._known) >= _MAX_FINGERPRINTS:
            self._known.clear()
        self._failed.pop(url, None)
        self._known[url] = fingerprint if isinstance(fingerprint, str) else None
        return self._known[url]


class RenderOnce:
    def __init__(
        self,
        *,
        orchestrator: Orchestrator,
        render: Passthrough,
        registry: EndpointRegistry,
        client: EngineClient,
        metrics: ProxyMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._orchestrator = orchestrator
        self._render = render
        self._registry = registry
        self._fingerprints = Fingerprints(client, clock)
        self._metrics = metrics

    def start(self) -> None:
        self._render.start()

    async def aclose(self) -> None:
        await self._fingerprints.aclose()
        await self._render.aclose()

    async def handle(self, request: ClientRequest) -> ProxyResponse:
        reason = fallback_reason(request.kind, request.body)
        if reason is not None:
            return await self._text_path(request, reason)
        rendered = rendered_request(request.kind, await self._rendered(request))
        if rendered is None:
            return await self._text_path(request, "render_shape")
        reason = rendered_fallback(rendered)
        if reason is not None:
            return await self._text_path(request, reason)
        self._metrics.render_once.labels(RENDERED).inc()
        decodes = (e.url for e in self._registry.snapshot().decode)
        await self._fingerprints.learn(
            decodes, str(request.body.get(MODEL)), request.authorization, request.via
        )
        generate = dataclasses.replace(
            request, kind=ApiKind.GENERATE, body=generate_body(request.body, rendered)
        )
        response = await self._orchestrator.handle(generate)
        try:
            return await self._answer(request, response)
        except BaseException:
            if response.stream is not None:
                response.stream.close()
            raise

    async def _text_path(self, request: ClientRequest, reason: str) -> ProxyResponse:
        self._metrics.render_once.labels(reason).inc()
        return await self._orchestrator.handle(request)

    async def _rendered(self, request: ClientRequest) -> Any:
        """The render answer (parsed); a render failure is retried on another render
        instance like a pass-through leg, and the engine's 4xx reaches the client."""
        route = _ROUTES[request.kind]
        passthrough = PassthroughRequest(
            route,
            request.body,
            orjson.dumps(request.body),
            request.request_id,
            request.authorization,
            request.session,
            request.via,
        )
        response = await self._render.handle(passthrough)
        try:
            return orjson.loads(response.body)
        except orjson.JSONDecodeError as exc:
            raise UpstreamProtocolError("render answered with invalid JSON", leg="decode") from exc

    async def _answer(self, request: ClientRequest, response: ProxyResponse) -> ProxyResponse:
        trace = current()
        model = str(request.body.get(MODEL, ""))
        decode = trace.decode_url
        fingerprint = None
        if decode is not None:
            asking = self._fingerprints.of(decode, model, request.authorization)
            with contextlib.suppress(TimeoutError):  # still asking: null this time
                fingerprint = await asyncio.wait_for(asking, _LEARN_WAIT)
        include_usage = includes_usage(request.body)
        ctx = AnswerContext(request.kind, model, fingerprint, not trace.decode_only, include_usage)
        if response.stream is not None:
            response.stream = TranslatedStream(response.stream, StreamTranslator(ctx).feed)
            return response
        if is_streaming(request.body):
            raise UpstreamProtocolError("decode engine answered a stream whole", leg="decode")
        try:
            generated = orjson.loads(response.body)
        except orjson.JSONDecodeError as exc:
            raise UpstreamProtocolError("generate answered invalid JSON", leg="decode") from exc
        if not isinstance(generated, dict) or generated.get(OUTPUT_MODE) != TEXT:
            raise UpstreamProtocolError("generate answered without its text", leg="decode")
        body = whole_answer(ctx, generated)
        return ProxyResponse(response.status, "application/json", response.request_id, body=body)
