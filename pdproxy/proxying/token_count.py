"""``TokenCounter``: an engine's own count of a text's tokens, for a migrated text stream.

vLLM packs several tokens into one stream chunk under load or speculative decoding, and a
text stream's chunks carry no count unless the client asked ``continuous_usage_stats``.
When such a stream is cut, what it delivered is counted by an engine of its model
(``POST /tokenize``, through the pass-through service: the usual pick, retries and leg
accounting), once per migration, nothing per token. The count is bounded by what the text
can hold: at least one token a chunk, at most one a byte (an engine that lies moves the
continuation's ``max_tokens`` within those bounds only). ``None`` when no engine answers
in time: the migration then counts one token a chunk, as before.
"""

from __future__ import annotations

import asyncio
import logging

import orjson

from pdproxy.errors import ProxyError
from pdproxy.proxying.exchange import ClientRequest
from pdproxy.proxying.passthrough import Passthrough, PassthroughRequest
from pdproxy.wire.routes import TOKENIZE
from pdproxy.wire.shaping import MODEL

logger = logging.getLogger(__name__)


class TokenCounter:
    def __init__(self, passthrough: Passthrough, *, timeout: float = 2.0) -> None:
        self._passthrough = passthrough
        self._timeout = timeout

    async def __call__(self, request: ClientRequest, text: str, chunks: int) -> int | None:
        """The tokens of ``text`` (delivered in ``chunks`` chunks with text) for
        ``request``'s model, as its engines count them."""
        body = {MODEL: request.body.get(MODEL), "prompt": text, "add_special_tokens": False}
        leg = PassthroughRequest(
            route=TOKENIZE,
            body=body,
            raw=orjson.dumps(body),
            request_id=None,
            authorization=request.authorization,
        )
        try:
            response = await asyncio.wait_for(self._passthrough.handle(leg), self._timeout)
        except (ProxyError, TimeoutError) as exc:
            logger.warning("migration: the delivered text could not be counted (%s)", exc)
            return None
        if response.stream is not None:  # a /tokenize never streams: not an answer
            response.stream.close()
            return None
        try:
            count = orjson.loads(response.body).get("count")
        except (orjson.JSONDecodeError, AttributeError):
            return None
        if type(count) is not int:
            return None
        return min(max(count, chunks), len(text.encode()))
