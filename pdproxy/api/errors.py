"""Renders every failure as OpenAI-shaped JSON; an engine's own error is relayed as it came."""

from __future__ import annotations

import logging

import orjson
from starlette.responses import Response

from pdproxy.errors import ProxyError, UpstreamStatusError

logger = logging.getLogger(__name__)

JSON = "application/json"


def error_body(error: ProxyError) -> tuple[int, bytes, str]:
    """Status, body and content type for ``error``."""
    if isinstance(error, UpstreamStatusError):
        return error.engine_status, error.body, error.content_type
    return error.status, orjson.dumps(error.to_dict()), JSON


def json_response(content: object, status: int = 200) -> Response:
    return Response(orjson.dumps(content), status_code=status, media_type=JSON)


def error_response(error: ProxyError) -> Response:
    status, body, content_type = error_body(error)
    return Response(body, status_code=status, media_type=content_type)


def internal_error() -> ProxyError:
    """What a client sees for a proxy bug: never the exception's text."""
    return ProxyError("internal proxy error; see the proxy's log")
