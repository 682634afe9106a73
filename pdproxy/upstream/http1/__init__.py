"""A pooled HTTP/1.1 client for the request legs, on httptools' parser (uvicorn's).

The legs are the hot path: aiohttp's client spends about 400 Python calls on each request
(URL, header multidicts, cookie jar, timers, payload registry, tracing hooks) and a dozen per
body read, a third of pdproxy's CPU per short request (docs/benchmarks.md, issue 12). The
legs need much less: one request at a time per connection, a bytes body with a
``Content-Length``, answers framed by ``Content-Length``, chunked encoding or the
connection's end, keep-alive with a bounded idle time, and limits per pool and per host.

It reads answers as RFC 9112 frames them, with aiohttp's caps on a head (interim 1xx
skipped, trailers dropped, a connection pooled again only at a clean message boundary; see
``connection``), a cap on a body read whole, and gzip/deflate bodies decoded (``coding``).

Only ``pdproxy.upstream.engine_client`` uses it; it maps these exceptions to ``pdproxy.errors``.
``ConnectFailed`` means nothing reached the engine (the retry-safety the orchestrator needs).

The package: ``errors`` (what it raises), ``connection`` (one connection's protocol: framing
and the caps on heads), ``response`` (``Response``, the answer being read, and its
``Headers``), ``coding`` (content codings), ``pool`` (``Pool``: keep-alive reuse, expiry,
limits, connecting).
"""

from pdproxy.upstream.http1.errors import (
    ConnectFailed,
    ConnectionBroken,
    ConnectTimeout,
    HTTPError,
    MalformedResponse,
    ReadTimeout,
    ResponseTooLarge,
)
from pdproxy.upstream.http1.pool import MAX_BODY, Pool
from pdproxy.upstream.http1.response import Headers, Response

__all__ = [
    "MAX_BODY",
    "ConnectFailed",
    "ConnectTimeout",
    "ConnectionBroken",
    "HTTPError",
    "Headers",
    "MalformedResponse",
    "Pool",
    "ReadTimeout",
    "Response",
    "ResponseTooLarge",
]
