"""Mid-stream migration: a streamed answer whose decode is cut continues on another decode.

When a decode's stream ends without its terminator (a reset or closed connection, the
stream watchdog, a drain that migrates) or with the engine's own error event, the relay
asks ``Migrations`` for a continuation: the same request with what the client already
received appended to its prompt (``wire.continuation``), through a prefill and another
decode as any request, never on a decode it was cut on. The continuation's stream is read
in the cut one's place, rewritten so that the client sees one stream. At most
``--migration-limit`` migrations per request, each spending the fleet-wide retry budget; a
request that cannot be continued exactly in kind (``not_migratable``) keeps the error
event, and nothing is kept for it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

from pdproxy.errors import EngineErrorEvent, ProxyError, UpstreamError, UpstreamTimeout
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.observability.request_context import current
from pdproxy.proxying.exchange import ClientRequest, ProxyResponse
from pdproxy.proxying.relay import ClientStream, StreamRelay
from pdproxy.proxying.resumable import Continuation, ResumableStream
from pdproxy.resilience.retry import RetryBudget
from pdproxy.wire.continuation import (
    Generated,
    Rewriter,
    continuation_body,
    not_migratable,
    read_generated,
    remaining,
)

logger = logging.getLogger(__name__)

# Serves a continuation on any decode but the ones named.
Serve = Callable[[ClientRequest, frozenset[str]], Awaitable[ProxyResponse]]
# An engine's count of a delivered text's tokens (its chunks with text given), or None.
CountTokens = Callable[[ClientRequest, str, int], Awaitable[int | None]]


class MigrationRequested(UpstreamError):
    """An operator drained the decode with ``migrate``: its streams move elsewhere now."""

    def __init__(self, url: str) -> None:
        super().__init__(f"decode {url} drained: stream migrated", leg="decode")


@dataclass(slots=True)
class _Migrating:
    """One request's migrations so far."""

    request: ClientRequest
    generated: Generated = field(default_factory=Generated)
    folded: Generated = field(default_factory=Generated)  # of the current stream, so far
    migrations: int = 0
    avoid: set[str] = field(default_factory=set)  # the decodes it was cut on


def cut_reason(failure: ProxyError) -> str | None:
    """The migration reason label of a cut, or None when it must not migrate (pdproxy's
    own shutdown, a prefill's failure)."""
    if isinstance(failure, MigrationRequested):
        return "drain"
    if isinstance(failure, EngineErrorEvent):
        return "engine_error"
    if not isinstance(failure, UpstreamError) or failure.leg != "decode":
        return None
    return "timeout" if isinstance(failure, UpstreamTimeout) else "reset"


class Migrations:
    def __init__(
        self,
        *,
        limit: int,
        budget: RetryBudget,
        metrics: ProxyMetrics,
        serve: Serve,
        count: CountTokens | None = None,
    ) -> None:
        self._limit = limit
        self._budget = budget
        self._metrics = metrics
        self._serve = serve
        self._count = count  # None: a text leg without usage counts one token a chunk

    def watch(self, request: ClientRequest, stream: ClientStream) -> ClientStream:
        """``request``'s stream, made to migrate when it is cut if it may."""
        if self._limit <= 0 or not_migratable(request.kind, request.body) is not None:
            return stream
        return self._arm(_Migrating(request), stream)

    def _arm(self, state: _Migrating, stream: ClientStream) -> ClientStream:
        if not isinstance(stream, StreamRelay):  # already wrapped: not a decode's own
            return stream
        if stream.origin is not None:
            state.avoid.add(stream.origin)
        state.folded = Generated()
        return ResumableStream(
            stream,
            functools.partial(self._resume, state, stream.origin),
            functools.partial(self._fold, state),
        )

    def _fold(self, state: _Migrating, stream: bytes) -> bool:
        part = read_generated(state.request.kind, stream)
        if part is None:
            return False
        state.folded.extend(part)
        return True

    async def _resume(
        self, state: _Migrating, origin: str | None, stream: bytes, failure: ProxyError
    ) -> Continuation | None:
        reason = cut_reason(failure)
        if reason is None:
            return None
        outcome, part = self._admit(state, stream)
        if part is not None:
            await self._count_leg(state.request, part)
            outcome, part = self._may_continue(state, part)
        if part is None:
            self._metrics.migrations.labels(reason, outcome).inc()
            return None
        carried = part.count()
        state.generated.add_leg(part)
        request = state.request
        body = continuation_body(request.kind, request.body, state.generated)
        state.migrations += 1
        # its legs wait for room in its tenant's order, but its deadline was the first
        # token's, long met: a continuation is never refused for it
        ticket = replace(request.ticket, deadline=None, deadline_ms=None)
        continued = replace(
            request,
            body=body,
            request_id=_continued_id(request.request_id, state.migrations),
            ticket=ticket,
        )
        try:
            response = await self._serve(continued, frozenset(state.avoid))
        except ProxyError as error:
            logger.warning("stream cut on %s (%s): migration failed: %s", origin, reason, error)
            self._metrics.migrations.labels(reason, "failed").inc()
            return None
        opened = response.stream
        if opened is None:  # a stream asked, a whole answer given: nothing to splice
            self._metrics.migrations.labels(reason, "failed").inc()
            return None
        self._metrics.migrations.labels(reason, "migrated").inc()
        self._record(origin, state, reason, opened)
        armed = self._arm(state, opened)  # past the limit too: its cut is counted
        return Continuation(armed, Rewriter(state.generated.identity, carried))

    def _admit(self, state: _Migrating, stream: bytes) -> tuple[str, Generated | None]:
        """What the cut stream delivered, if it may migrate; else the outcome label."""
        if state.migrations >= self._limit:
            return "limit", None
        last = read_generated(state.request.kind, stream)
        if last is None:
            return "unreadable", None
        part, state.folded = state.folded, Generated()
        part.extend(last)
        return "migrated", part

    async def _count_leg(self, request: ClientRequest, part: Generated) -> None:
        """A text leg whose chunks said no count: its text counted by an engine, since a
        chunk may carry several tokens (``token_count``)."""
        if self._count is None or part.leg_tokens is not None or part.token_ids:
            return
        text = part.whole_text()
        if text:
            part.leg_tokens = await self._count(request, text, part.tokens)

    def _may_continue(self, state: _Migrating, part: Generated) -> tuple[str, Generated | None]:
        left = remaining(state.request.kind, state.request.body, state.generated.tokens)
        if left is not None and part.count() >= left:
            return "finished", None
        if not self._budget.try_spend():
            return "budget", None
        return "migrated", part

    def _record(
        self, origin: str | None, state: _Migrating, reason: str, stream: ClientStream
    ) -> None:
        trace = current()
        hop = (
            f"{origin} after {state.generated.tokens} tokens ({reason})"
            f" -> {trace.prefill_url if not trace.decode_only else '-'},{stream.origin}"
        )
        trace.migrations = [*trace.migrations, hop] if trace.migrations else [hop]
        logger.info("stream migrated: %s", hop)


def _continued_id(request_id: str | None, migrations: int) -> str | None:
    """The client's request id with the migration's number (the engines see a new request);
    a fresh id when the client gave none."""
    return None if request_id is None else f"{request_id}-m{migrations}"
