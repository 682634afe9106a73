"""Concurrent NIXL push legs (``--kv-connector nixl-push``), and no decode left waiting for
a write that will not come.

vLLM 0.32's push decode waits for its prefill's write with no deadline of its own, and a
decode request aborted while it waits leaks its blocks and keeps its engine stepping; only
the write (a prefill leg with the same id and prompt, finished on the same prefill) or a
restart frees them (docs/push.md). So, per concurrent push:

* the prefill leg is never cancelled: a client that leaves, or a decode that fails, leaves
  it to finish in the background (its write is what frees a decode that may hold blocks);
  a client that leaves before the decode's first byte leaves the decode to be closed once
  that byte shows its KV arrived;
* a prefill leg that fails with a 5xx or a broken answer is sent again, same id, prompt and
  rank, to the same prefill while it is routable (once): its write frees the decode and may
  still serve the client;
* otherwise, or when the decode's first byte does not come within ``--push-wait-secs`` of
  the prefill's answer, the decode is stranded: its leg closed, the instance out of
  rotation until its KV usage is back to 0 (``OutlierDetector.on_stranded``), the prefill's
  coordinates forgotten (it may have restarted under the same engine id, which vLLM's decode
  does not notice), and the request retried on a fresh pair; the prefill leg is sent again
  in the background whenever its prefill is routable, until one finishes (its write frees
  the decode's blocks: vLLM parks the registration with no expiry);
* a client's request id that another request's push holds is refused (409): the prefill
  pairs the legs by id, so two requests sharing one could swap their KV (serial pushes too:
  their decodes may register in either order).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from pdproxy.config.upstream import Timeouts
from pdproxy.connectors import Transfer
from pdproxy.connectors.nixl_push import NixlPushConnector
from pdproxy.errors import (
    RequestIdInUse,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from pdproxy.observability.push_metrics import PushMetrics
from pdproxy.observability.request_context import current
from pdproxy.proxying.exchange import ClientRequest, ProxyResponse
from pdproxy.proxying.legs import Legs, LegSize, cancel
from pdproxy.resilience.outlier import STRANDED_MAX, OutlierDetector
from pdproxy.wire.shaping import client_request_id, is_streaming

logger = logging.getLogger(__name__)

MAX_HEALS = 256  # stranded decodes healed later at once (each holds its request's body)
HEAL_BACKOFF = (0.25, 5.0)  # seconds between a later heal's tries: first, most


@dataclass(slots=True, eq=False)
class _Push:
    """One concurrent push: its two legs' tasks."""

    request: ClientRequest
    transfer: Transfer
    size: LegSize
    claimed: str | None  # the client's request id it holds
    prefill: asyncio.Task[dict[str, Any]]
    decode: asyncio.Task[ProxyResponse]


class PushLegs:
    def __init__(
        self,
        *,
        connector: NixlPushConnector,
        legs: Legs,
        outliers: OutlierDetector,
        metrics: PushMetrics,
        timeouts: Timeouts,
    ) -> None:
        self._connector = connector
        self._legs = legs
        self._outliers = outliers
        self._metrics = metrics
        self._wait = timeouts.push_wait  # --push-wait-secs
        # A concurrent decode answers once its prefill (and perhaps its heal) wrote the KV:
        # its headers are bounded by those deadlines, this is only the backstop.
        self._decode_headers = 2 * timeouts.prefill + self._wait + timeouts.decode_headers
        # A client's X-Request-Id -> [the request holding it, its holds]: a serial push holds
        # it while served, a concurrent one until neither leg can still be paired by it.
        self._claims: dict[str, list[Any]] = {}
        self._pushes: set[_Push] = set()  # their legs, cancelled only when pdproxy stops
        self._background: set[asyncio.Task[Any]] = set()
        self._healing = 0  # stranded decodes whose prefill leg is to be sent again

    def concurrent(self, request: ClientRequest, transfer: Transfer) -> bool:
        """Whether this request's legs go at once; the choice goes to the access line."""
        dispatch = self._connector.dispatch_of(transfer, streaming=is_streaming(request.body))
        current().push = dispatch
        self._metrics.transfers.labels(dispatch).inc()
        return dispatch == "concurrent"

    def status(self) -> dict[str, Any]:
        peers = self._connector.peers
        return {
            "dispatch": self._connector.dispatch,
            "prefill_ranks_known": peers.known(),
            "prefill_restarts": peers.restarts,
            "request_ids_held": len(self._claims),
            "healing": self._healing,
        }

    def claim(self, request: ClientRequest) -> str | None:
        """Hold the client's request id for ``request`` (None: it sent none, and every
        transfer gets a fresh one); raises ``RequestIdInUse`` if another request holds it.
        The same request may hold it again (a retry, a migration): its legs carry the same
        prompt, so whichever of its prefill legs writes a decode's blocks, they are right."""
        request_id = request.request_id
        if request_id is None or client_request_id(request_id) != request_id:
            return None
        held = self._claims.get(request_id)
        if held is None:
            self._claims[request_id] = [request, 1]
        elif held[0] is request:
            held[1] += 1
        else:
            raise RequestIdInUse(
                f"a request with X-Request-Id {request_id!r} is in flight; the prefill pairs"
                " the legs by id, so each request needs its own"
            )
        return request_id

    def release(self, request_id: str | None) -> None:
        held = self._claims.get(request_id) if request_id is not None else None
        if held is not None:
            held[1] -= 1
            if held[1] <= 0:
                del self._claims[request_id]  # type: ignore[arg-type]

    async def run(self, request: ClientRequest, transfer: Transfer, size: LegSize) -> ProxyResponse:
        """Both legs at once; the decode's answer once its first byte came."""
        claimed = self.claim(request)  # held past the request, until both legs are over
        push = _Push(
            request,
            transfer,
            size,
            claimed,
            asyncio.create_task(self._prefill(request, transfer, size)),
            asyncio.create_task(
                self._legs.decode(request, transfer, None, headers_within=self._decode_headers)
            ),
        )
        self._pushes.add(push)
        conclusion = asyncio.create_task(self._conclude(push))
        self._keep(self._release_id(push, conclusion))
        try:
            return await asyncio.shield(conclusion)
        except asyncio.CancelledError:
            # The client left: the legs finish; a decode that got its KV is then closed.
            conclusion.add_done_callback(_close_unread)
            raise

    async def decode(
        self, request: ClientRequest, transfer: Transfer, answer: dict[str, Any]
    ) -> ProxyResponse:
        """A serial push's decode leg (``answer`` is the prefill's). A stream's first byte
        must come within ``--push-wait-secs``: P already holds the KV, so a decode still
        waiting registered with an agent that will not write (a prefill restarted under
        the same engine id, or its lease over). A client that leaves cancels the leg as
        always: the write follows the registration within milliseconds."""
        if not is_streaming(request.body):
            return await self._legs.decode(request, transfer, answer)
        leg = asyncio.create_task(self._legs.decode(request, transfer, answer))
        try:
            return await asyncio.wait_for(asyncio.shield(leg), self._wait)
        except TimeoutError:
            why = f"no KV {self._wait:g} s after it was sent"
            await self._strand(request, transfer, LegSize(), leg, why)
            raise UpstreamTimeout(
                f"decode engine got no KV within {self._wait:g} s of its leg", leg="decode"
            ) from None
        except asyncio.CancelledError:
            await cancel(leg)
            raise

    async def _prefill(
        self, request: ClientRequest, transfer: Transfer, size: LegSize
    ) -> dict[str, Any]:
        """The prefill leg, sent once more to the same prefill if it failed in a way a
        second try may not (a 5xx, a broken answer) while that prefill is routable."""
        try:
            return await self._legs.prefill(request, transfer, size)
        except UpstreamError as error:
            prefill = transfer.decision.prefill
            if not isinstance(error, UpstreamProtocolError) or not (
                prefill.routable and self._outliers.available(prefill)
            ):
                raise
            logger.warning(
                "%s: prefill %s failed (%s); sent again so its decode gets the KV",
                transfer.request_id,
                prefill.url,
                error.message,
            )
        try:
            answer = await self._legs.prefill(request, transfer, size)
        except UpstreamError:
            self._metrics.heals.labels("failed").inc()
            raise
        self._metrics.heals.labels("healed").inc()
        return answer

    async def _conclude(self, push: _Push) -> ProxyResponse:
        """The decode's answer; raises the failure that ends this pair (stranding a decode
        left waiting). The prefill leg is never cancelled."""
        await asyncio.wait((push.prefill, push.decode), return_when=asyncio.FIRST_COMPLETED)
        if push.decode.done():
            if push.decode.exception() is not None and not push.prefill.done():
                # A decode cut while it waited keeps its blocks until the prefill's write:
                # if that prefill fails too, nothing frees them.
                push.prefill.add_done_callback(lambda _: self._after_cut(push))
            return push.decode.result()  # its failure raises: the prefill goes on
        error = push.prefill.exception()
        if error is not None:
            why = f"its prefill failed ({error})"
            await self._strand(push.request, push.transfer, push.size, push.decode, why)
            raise error
        try:
            return await asyncio.wait_for(asyncio.shield(push.decode), self._wait)
        except TimeoutError:
            why = f"no KV {self._wait:g} s after its prefill answered"
            # The prefill said it finished, and wrote nothing where its answer pointed: it
            # restarted under the same engine id, or its answer cannot be trusted.
            self._legs.count_failure(push.transfer.decision.prefill, "push_not_written")
            await self._strand(push.request, push.transfer, push.size, push.decode, why)
            raise UpstreamTimeout(
                f"decode engine got no KV within {self._wait:g} s of its prefill's answer",
                leg="decode",
            ) from None

    def _after_cut(self, push: _Push) -> None:
        if push.prefill.cancelled() or push.prefill.exception() is not None:
            why = "its leg failed, then its prefill"
            self._keep(self._strand(push.request, push.transfer, push.size, push.decode, why))

    async def _strand(
        self,
        request: ClientRequest,
        transfer: Transfer,
        size: LegSize,
        decode: asyncio.Task[ProxyResponse],
        why: str,
    ) -> None:
        """Close a decode leg whose KV will not come; its blocks leak in vLLM 0.32, so the
        instance stays out of rotation until its KV usage is back to 0, and the prefill leg
        that frees them is sent again once its prefill is back (``_heal_later``)."""
        decision = transfer.decision
        await cancel(decode)
        self._outliers.on_stranded(decision.decode)
        self._connector.peers.forget(decision.prefill.url)
        self._metrics.stranded.labels(decision.decode.url).inc()
        logger.warning(
            "%s: decode %s stranded, %s; out of rotation until its KV usage is 0",
            transfer.request_id,
            decision.decode.url,
            why,
        )
        if self._healing < MAX_HEALS:
            self._healing += 1
            self._keep(self._heal_later(request, transfer, size))

    async def _heal_later(self, request: ClientRequest, transfer: Transfer, size: LegSize) -> None:
        """The stranded decode's registration waits on its prefill (vLLM parks it with no
        expiry): a prefill leg with the same id, prompt and rank that finishes there is
        written into it and frees its blocks. Sent with a backoff whenever that prefill is
        routable, until it succeeds, the decode is no longer stranded, or ``STRANDED_MAX``."""
        prefill, decode = transfer.decision.prefill, transfer.decision.decode
        claimed = self.claim(request)  # no other request's prefill may pair with it meanwhile
        deadline, delay = time.monotonic() + STRANDED_MAX, HEAL_BACKOFF[0]
        try:
            while time.monotonic() < deadline and self._outliers.stranded(decode):
                await asyncio.sleep(delay)
                delay = min(delay * 2, HEAL_BACKOFF[1])
                if not (prefill.routable and self._outliers.available(prefill)):
                    continue
                try:
                    await self._legs.prefill(request, transfer, size)
                except UpstreamError:
                    continue
                self._metrics.heals.labels("healed_later").inc()
                logger.info("%s: stranded decode %s healed", transfer.request_id, decode.url)
                return
        finally:
            self._healing -= 1
            self.release(claimed)

    async def _release_id(self, push: _Push, conclusion: asyncio.Task[ProxyResponse]) -> None:
        """The request id is free again once neither leg can still be paired by it."""
        try:
            await asyncio.gather(push.prefill, push.decode, conclusion, return_exceptions=True)
        finally:
            self.release(push.claimed)
            self._pushes.discard(push)

    def _keep(self, coroutine: Any) -> None:
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def aclose(self) -> None:
        legs = [task for push in self._pushes for task in (push.prefill, push.decode)]
        await cancel(*legs, *self._background)


def _close_unread(conclusion: asyncio.Task[ProxyResponse]) -> None:
    """A push whose client left: close the decode's stream it would have read."""
    if conclusion.cancelled() or conclusion.exception() is not None:
        return
    stream = conclusion.result().stream
    if stream is not None:
        stream.close()
