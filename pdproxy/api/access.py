"""The end of a client request: its metrics, its span and its access line.

One access line per generation request, at info on ``pdproxy.access`` (``--no-access-log``
silences it): endpoint, status, outcome, the prefill and decode chosen (and P's DP rank),
retries, the prefill leg's and the decode headers' times, the client's time to first byte
and in all, the body bytes sent, and whether it was served decode-only. Never a prompt or
a key. With the access log off and tracing off, finishing costs two metric updates.
"""

from __future__ import annotations

import logging
import time

from pdproxy.observability.flow_book import FlowBook
from pdproxy.observability.log import ACCESS_LOGGER
from pdproxy.observability.metrics import ProxyMetrics
from pdproxy.observability.request_context import RequestTrace

access_logger = logging.getLogger(ACCESS_LOGGER)


class RequestFinisher:
    def __init__(
        self, metrics: ProxyMetrics, *, access_log: bool, book: FlowBook | None = None
    ) -> None:
        self._metrics = metrics
        self._access_log = access_log
        self._book = book  # flow control's: deadlines met, predictions' errors

    def __call__(self, trace: RequestTrace) -> None:
        trace.finished = finished = time.perf_counter()
        self._metrics.count_request(trace.endpoint, trace.outcome)
        # The client's latency is the engines' answer's: refusals would only blur it.
        if trace.first_byte is not None and 0 < trace.status < 400:
            ttfb = trace.first_byte - trace.started
            self._metrics.observe_request(trace.endpoint, ttfb, finished - trace.started)
            if trace.ticket is not None and self._book is not None:
                self._book.answered(trace.ticket, ttfb, trace.predicted_ttft)
        trace.span.end(trace.span_attributes)
        if self._access_log and access_logger.isEnabledFor(logging.INFO):
            # makeRecord + handle: what .info() does, less the caller lookup (a stack walk
            # for a file and line number the access line never shows).
            access_logger.handle(
                access_logger.makeRecord(
                    ACCESS_LOGGER,
                    logging.INFO,
                    __file__,
                    0,
                    "request finished",
                    (),
                    None,
                    extra={"fields": trace.access_fields()},
                )
            )
