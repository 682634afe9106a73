"""A request's time to first token, predicted once its pair is chosen, against its
deadline (``x-slo-ttft-ms``).

Admission already refused what its own queue could not serve in time
(``proxying.admission``); this is the second look, with what only the pick knows: the
chosen prefill's tokens in flight and measured speed, the prefix its KV events say it
holds (the leg computes only the rest), and the time from a prefill's answer to the
client's first byte as measured lately (the KV transfer and the decode's first step, or
for a whole answer the decode's whole generation). A request predicted to miss is
refused at once with 429 and ``Retry-After``, never sent; every prediction made is kept
on the request's trace, and its error against the measured first byte is a metric
(``FlowBook.answered``), so an operator sees whether to trust it.

Nothing is predicted before the prefills' speed has been measured at about the
request's size: no request is refused on a guess.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from pdproxy.errors import Overloaded
from pdproxy.flow.ticket import Ticket
from pdproxy.observability.flow_book import FlowBook
from pdproxy.observability.request_context import current
from pdproxy.scheduling.speed import SpeedTracker
from pdproxy.types import PairDecision

_ALPHA = 0.2  # weight of the newest hand-over in its moving mean


class TtftPredictor:
    def __init__(
        self, speeds: SpeedTracker, book: FlowBook, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._speeds = speeds
        self._book = book
        self._clock = clock
        # seconds from a prefill's answer to the client's first byte: [whole, streamed]
        self._after_prefill = [0.0, 0.0]
        self._seen = [False, False]

    def observe_after_prefill(self, streamed: bool) -> None:
        """A serial request's decode answered (a stream: its first bytes): the time since
        its prefill's answer joins the hand-over's mean."""
        answered = current().prefill_answered
        if answered is None:
            return
        seconds = time.perf_counter() - answered
        i = int(streamed)
        if not self._seen[i]:
            self._after_prefill[i], self._seen[i] = seconds, True
        else:
            self._after_prefill[i] += _ALPHA * (seconds - self._after_prefill[i])

    def check(
        self, ticket: Ticket, decision: PairDecision, computed: float, streamed: bool
    ) -> None:
        """Predict the request's first byte on ``decision`` (its prefill computing
        ``computed`` tokens); raises ``Overloaded`` when that passes its deadline."""
        if ticket.deadline is None:
            return
        prefill = self._speeds.prefill_seconds(decision.prefill, computed)
        if prefill is None:
            return
        rest = prefill + self._after_prefill[int(streamed)]
        trace = current()
        trace.predicted_ttft = time.perf_counter() - trace.started + rest
        left = ticket.deadline - self._clock()
        if rest <= left:
            return
        self._book.refused(ticket, "deadline")
        raise Overloaded(
            f"pdproxy cannot meet the request's deadline (x-slo-ttft-ms:"
            f" {ticket.deadline_ms:g}): its first token is predicted in {rest * 1000:.0f} ms"
            f" from now on the prefill chosen, {max(left, 0.0) * 1000:.0f} ms are left;"
            " retry later",
            retry_after=max(1, round(rest)),
            code="deadline_exceeded",
        )
