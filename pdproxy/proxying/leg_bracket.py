"""The bracket every leg runs in, written once for the two legs and the pass-through.

A leg is opened on its endpoint (counted there through ``leg_counts``, and in the legs
metric), then ends one of three ways, each with its verdict (``Verdicts``) and its span:
``failed`` (an error the request may retry elsewhere), ``abandoned`` (cancelled: the
client left), or a success the caller reports (a stream hands its close to the relay,
which calls ``stream_closed``). ``close`` uncounts it; a leg's end also lets the next leg
waiting for room on its role go (flow control's ``LegRoom``, when on).
"""

from __future__ import annotations

from pdproxy.errors import ProxyError, UpstreamError
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.observability.request_context import RequestTrace
from pdproxy.observability.tracing import LegSpan
from pdproxy.proxying.leg_counts import enter, leave
from pdproxy.proxying.leg_room import LegRoom
from pdproxy.proxying.verdicts import Verdicts
from pdproxy.types import Endpoint


class LegBracket:
    def __init__(
        self, verdicts: Verdicts, metrics: ProxyMetrics, room: LegRoom | None = None
    ) -> None:
        self.verdicts = verdicts
        self._metrics = metrics
        self._room = room  # flow control: a leg's end lets the next waiting leg of its role go

    def open(
        self, endpoint: Endpoint, rank: int | None, weight: float = 1.0, tokens: float = 0.0
    ) -> None:
        """Count a leg on ``endpoint`` while it runs (``leg_counts.enter``)."""
        enter(endpoint, rank, weight, tokens)
        self._metrics.count_leg(endpoint.role.value, endpoint.url)

    def close(
        self, endpoint: Endpoint, rank: int | None, weight: float = 1.0, tokens: float = 0.0
    ) -> None:
        """Uncount it, with the figures ``open`` counted."""
        leave(endpoint, rank, weight, tokens)
        if self._room is not None:
            self._room.freed(endpoint.role)

    def failed(
        self, endpoint: Endpoint, error: ProxyError, span: LegSpan, trace: RequestTrace
    ) -> None:
        """A leg failed before the client's response started (it may be retried):
        ``endpoint`` is the one at fault."""
        self.verdicts.judge(endpoint, error)
        trace.leg_failed()
        span.end(type(error).__name__)

    def abandoned(self, endpoint: Endpoint, span: LegSpan) -> None:
        """The leg was cancelled (the client left): no verdict on the engine."""
        self.verdicts.abandoned(endpoint)
        span.end("abandoned")

    def stream_closed(
        self,
        endpoint: Endpoint,
        rank: int | None,
        failure: ProxyError | None,
        leg: str,
        span: LegSpan,
    ) -> None:
        """A relayed stream ended: uncounted, and judged when it was the engine's fault
        (an ``UpstreamError`` of this ``leg``; a client that left is none)."""
        self.close(endpoint, rank)
        if isinstance(failure, UpstreamError) and failure.leg == leg:
            self.verdicts.judge(endpoint, failure)
        span.end(None if failure is None else type(failure).__name__)
