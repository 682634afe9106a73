"""The pass-through endpoints (``pdproxy.wire.routes``) as raw ASGI handlers.

Each is served like a generation endpoint: a draining proxy answers 503 and a missing or
wrong client key 401 first, the body is read once under ``--max-body-bytes`` and must be a
JSON object, admission control applies, a client that leaves cancels the work (closing the
upstream leg, so vLLM aborts it), and the request ends with its metrics
(``pdproxy_requests_total{endpoint=<path>}``), span and access line. Then ``Passthrough``
answers it from one decode instance.
"""

from __future__ import annotations

import functools

from starlette.types import Receive

from pdproxy.api.openai import ServedEndpoint, Work, legs_via
from pdproxy.api.request_body import json_object, read_json_body
from pdproxy.api.state import AppState
from pdproxy.flow.ticket import DEFAULT_TICKET
from pdproxy.proxying.passthrough import PassthroughRequest
from pdproxy.wire.routes import PassthroughRoute
from pdproxy.wire.shaping import REQUEST_ID_KEY


class PassthroughEndpoint(ServedEndpoint):
    """``POST /tokenize``, ``GET /version``, ... : one route of ``routes.ROUTES``."""

    def __init__(self, route: PassthroughRoute, state: AppState) -> None:
        super().__init__(state)
        self.route = route
        self.path = route.path

    async def answer(self, headers: dict[str, str], receive: Receive) -> Work:
        request = await self._read_request(headers, receive)
        return functools.partial(self._state.passthrough.handle, request), DEFAULT_TICKET

    async def _read_request(self, headers: dict[str, str], receive: Receive) -> PassthroughRequest:
        state = self._state
        # With an engine key the client's own never reaches an engine; else it passes through.
        upstream_auth = state.engine_authorization or headers.get("authorization")
        session = headers.get(state.config.scheduling.session_header) or None
        request_id = headers.get(REQUEST_ID_KEY)
        via = legs_via(self.hop, headers)
        if self.route.method == "GET":
            return PassthroughRequest(
                self.route, None, b"", request_id, upstream_auth, session, via
            )
        raw = await read_json_body(headers, receive, state.config.max_body_bytes)
        body = json_object(raw)
        return PassthroughRequest(self.route, body, raw, request_id, upstream_auth, session, via)
