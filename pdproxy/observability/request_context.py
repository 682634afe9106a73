"""One client request's record, held in a ``ContextVar`` while the request is served.

``RequestTrace`` is what the access line, the client latency histograms and the request
span report when the request ends. The API layer opens it on arrival (``bind``) and
finishes it; the legs fill in where they went and when (``prefill_started``,
``decode_started``, ...), and set the request id both legs carry, which every log line
then shows (``pdproxy.observability.log``). Tasks a request starts (a concurrent prefill, a KV
release) copy the context, so their lines carry the id too.

Times are ``time.perf_counter()`` stamps; a stamp stays None when its event never happened
(no prefill on a decode-only request, no answer before an error). A trace is mutated only
on the event loop. Nothing here ever holds a prompt or a key.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass, field
from typing import Any

from pdproxy.flow.ticket import Ticket
from pdproxy.observability.tracing import NULL_REQUEST_SPAN, AttributeValue, LegSpan, RequestSpan

_CURRENT: contextvars.ContextVar[RequestTrace | None] = contextvars.ContextVar(
    "pdproxy_request", default=None
)


def _ms(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else round((end - start) * 1000, 1)


@dataclass(slots=True)
class RequestTrace:
    endpoint: str  # the API path, as the metrics' endpoint label
    span: RequestSpan = NULL_REQUEST_SPAN
    started: float = field(default_factory=time.perf_counter)
    request_id: str | None = None  # fixed by the connector; sent to both legs
    prefill_url: str | None = None  # of the last prefill leg sent
    prefill_dp_rank: int | None = None
    decode_url: str | None = None  # of the last decode leg sent
    decode_only: bool = False  # served by a decode alone, no prefill
    push: str | None = None  # nixl-push: concurrent, or serial and why (proxying.push)
    # kv-events: the prompt tokens the chosen prefill's and decode's events say they hold
    predicted_prefill_cached: int | None = None
    predicted_decode_cached: int | None = None
    retries: int = 0  # legs sent again after a failed one
    migrations: list[str] | None = None  # each mid-stream migration: from, after, to
    prefill_sent: float | None = None
    prefill_ended: float | None = None
    prefill_answered: float | None = None  # P's answer arrived whole (2xx)
    decode_sent: float | None = None
    decode_headers: float | None = None
    first_byte: float | None = None  # first body byte sent to the client
    finished: float | None = None
    status: int = 0  # the client's response status; 0 if none was sent
    outcome: str = "error"  # the requests_total outcome label
    bytes_sent: int = 0  # body bytes sent to the client
    answered: bool = False  # the response's last bytes went to the server: nothing can cancel it
    _after_failure: bool = False  # the last leg failed: the next one is a retry
    ticket: Ticket | None = None  # flow control's view of it (None: none to say)
    predicted_ttft: float | None = None  # seconds to its first byte, predicted when sent

    def prefill_started(
        self, request_id: str, url: str, rank: int | None, headers: dict[str, str]
    ) -> LegSpan:
        """A prefill leg is about to be sent with ``headers``; returns its span."""
        self._leg_started(request_id)
        self.prefill_url, self.prefill_dp_rank = url, rank
        self.prefill_sent, self.prefill_ended = time.perf_counter(), None
        return self.span.leg("prefill", url, headers)

    def decode_started(self, request_id: str, url: str, headers: dict[str, str]) -> LegSpan:
        """A decode leg is about to be sent with ``headers``; returns its span."""
        self._leg_started(request_id)
        self.decode_url = url
        self.decode_sent, self.decode_headers = time.perf_counter(), None
        return self.span.leg("decode", url, headers)

    def _leg_started(self, request_id: str) -> None:
        self.request_id = request_id
        if self._after_failure:
            self.retries += 1
            self._after_failure = False

    def leg_failed(self) -> None:
        """A leg failed before the client's response started; a leg sent next is a retry."""
        self._after_failure = True

    def access_fields(self) -> dict[str, Any]:
        """The access line's fields (no prompt, no key)."""
        return {
            "endpoint": self.endpoint,
            "status": self.status,
            "outcome": self.outcome,
            "prefill_url": self.prefill_url,
            "decode_url": self.decode_url,
            "prefill_dp_rank": self.prefill_dp_rank,
            "retries": self.retries,
            "prefill_sent_ms": _ms(self.started, self.prefill_sent),
            "prefill_ms": _ms(self.prefill_sent, self.prefill_ended),
            "decode_sent_ms": _ms(self.started, self.decode_sent),
            "decode_headers_ms": _ms(self.decode_sent, self.decode_headers),
            "ttfb_ms": _ms(self.started, self.first_byte),
            "total_ms": _ms(self.started, self.finished),
            "bytes_sent": self.bytes_sent,
            "decode_only": self.decode_only,
            "migrations": self.migrations,
            **({} if self.push is None else {"push": self.push}),
            **self._predicted(),
            **self._flow(),
        }

    def _flow(self) -> dict[str, Any]:
        """Flow control's fields, only for a request it saw (unchanged without)."""
        ticket = self.ticket
        if ticket is None:
            return {}
        return {
            "tenant": ticket.tenant,
            "priority": ticket.priority,
            "deadline_ms": ticket.deadline_ms,
            "predicted_ttft_ms": _ms(0.0, self.predicted_ttft),
        }

    def _predicted(self) -> dict[str, int]:
        """kv-events' predictions, only where made (the access line is unchanged without)."""
        out = {}
        if self.predicted_prefill_cached is not None:
            out["predicted_prefill_cached"] = self.predicted_prefill_cached
        if self.predicted_decode_cached is not None:
            out["predicted_decode_cached"] = self.predicted_decode_cached
        return out

    def span_attributes(self) -> dict[str, AttributeValue]:
        """The request span's attributes, once the request is over."""
        attributes: dict[str, AttributeValue] = {
            "pdproxy.endpoint": self.endpoint,
            "pdproxy.outcome": self.outcome,
            "http.response.status_code": self.status,
            "pdproxy.retries": self.retries,
            "pdproxy.decode_only": self.decode_only,
        }
        for key, value in (
            ("pdproxy.request_id", self.request_id),
            ("pdproxy.prefill.url", self.prefill_url),
            ("pdproxy.prefill.dp_rank", self.prefill_dp_rank),
            ("pdproxy.decode.url", self.decode_url),
            ("pdproxy.prefill.predicted_cached_tokens", self.predicted_prefill_cached),
            ("pdproxy.decode.predicted_cached_tokens", self.predicted_decode_cached),
            ("pdproxy.migrations", "; ".join(self.migrations) if self.migrations else None),
        ):
            if value is not None:
                attributes[key] = value
        return attributes


def bind(trace: RequestTrace) -> contextvars.Token[RequestTrace | None]:
    """Make ``trace`` the current request's; pass the token to ``unbind`` when it ends."""
    return _CURRENT.set(trace)


def unbind(token: contextvars.Token[RequestTrace | None]) -> None:
    _CURRENT.reset(token)


def current() -> RequestTrace:
    """The current request's trace; outside a client request (a unit test driving the
    orchestrator), a detached one that nobody reports."""
    trace = _CURRENT.get()
    return trace if trace is not None else RequestTrace("")


def current_request_id() -> str | None:
    trace = _CURRENT.get()
    return None if trace is None else trace.request_id


def bind_predicted(prefill: int | None, decode: int | None) -> None:
    """kv-events predicted these cached prompt tokens on the chosen prefill and decode."""
    trace = _CURRENT.get()
    if trace is not None:
        trace.predicted_prefill_cached, trace.predicted_decode_cached = prefill, decode


def bind_request_id(request_id: str) -> None:
    """The connector has fixed the request id (before any leg is sent)."""
    trace = _CURRENT.get()
    if trace is not None:
        trace.request_id = request_id
