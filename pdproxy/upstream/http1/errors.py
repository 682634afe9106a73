"""What pdproxy.upstream.http1 raises; ``ConnectFailed``: nothing reached the engine."""

from __future__ import annotations

import ssl


class HTTPError(Exception):
    """Base of this client's failures."""


class ConnectFailed(HTTPError):
    """The connection could not be made (refused, unreachable, TLS handshake): nothing was
    sent. ``tls`` is the handshake's failure when that is what failed."""

    def __init__(self, message: str, tls: ssl.SSLError | None = None) -> None:
        super().__init__(message)
        self.tls = tls


class ConnectTimeout(ConnectFailed):
    """Connecting took longer than the connect timeout."""


class ReadTimeout(HTTPError):
    """The engine stayed silent past the read timeout, or the answer missed its deadline."""


class ConnectionBroken(HTTPError):
    """The connection ended or broke before the answer was whole (the OS's or TLS's error,
    if any, is the ``__cause__``)."""


class MalformedResponse(HTTPError):
    """The engine's bytes are not an HTTP/1.1 answer pdproxy can use: unparsable, a status
    outside 100-599, ``101`` (never asked for), a head past its caps, a body where none may
    be, an unknown transfer or content coding. The message never quotes the engine's
    bytes."""


class ResponseTooLarge(HTTPError):
    """A buffered body passed the pool's ``max_body`` bytes (decoded, for a coded one)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the answer's body is over {limit} bytes")
        self.limit = limit
