"""An error as a whole HTTP/1.1 response, for the listener's refusals below ASGI (431, 408,
400, 503), where no framework writes the answer."""

from __future__ import annotations

import http

import orjson

from pdproxy.errors import ProxyError


def error_bytes(error: ProxyError, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A whole HTTP/1.1 response carrying ``error`` as OpenAI-shaped JSON, ending the
    connection (Retry-After: 1 on a 503)."""
    body = orjson.dumps(error.to_dict())
    phrase = http.HTTPStatus(error.status).phrase.encode()
    lines = [b"HTTP/1.1 %d %b\r\n" % (error.status, phrase)]
    lines += [b"%b: %b\r\n" % (name, value) for name, value in default_headers]
    lines.append(b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body))
    if error.status == 503:
        lines.append(b"retry-after: 1\r\n")
    lines += [b"connection: close\r\n\r\n", body]
    return b"".join(lines)
