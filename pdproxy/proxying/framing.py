"""How an engine's SSE stream ends, and how pdproxy ends one that was cut.

A vLLM completions or chat stream always ends with ``data: [DONE]``; a Responses API
stream with its terminal event. ``Framing`` names those ends and the error event that
ends a cut stream instead (``pdproxy.proxying.relay`` checks a stream's tail against it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import orjson

from pdproxy.errors import ProxyError

_DONE = b"data: [DONE]"
SSE_DONE = _DONE + b"\n\n"
_TAIL = 32


def sse_error_event(error: ProxyError) -> bytes:
    """One terminal SSE error event, followed by ``[DONE]`` as vLLM does after an error."""
    return b"data: " + orjson.dumps(error.to_dict()) + b"\n\ndata: [DONE]\n\n"


def responses_error_event(error: ProxyError) -> bytes:
    """A Responses API stream's terminal error event (no ``[DONE]``: that API has none);
    its ``error`` object makes OpenAI's SDKs raise, as for the other streams."""
    return b"event: error\ndata: " + orjson.dumps(error.to_dict()) + b"\n\n"


@dataclass(frozen=True, slots=True)
class Framing:
    """How an engine's stream ends: a complete one's last bytes (trailing whitespace
    stripped) end with one of ``ends``; a cut one is ended with ``error_event``."""

    ends: tuple[bytes, ...]
    error_event: Callable[[ProxyError], bytes]
    tail: int = _TAIL  # bytes of the stream's end kept to check it


OPENAI_SSE = Framing((_DONE,), sse_error_event)
# vLLM's /v1/responses stream ends with its terminal event, whose JSON ends with its type
# (pydantic dumps the openai models' fields in order: ..., sequence_number, type).
RESPONSES_SSE = Framing(
    tuple(
        b'"type":"%s"}' % name
        for name in (b"response.completed", b"response.incomplete", b"response.failed", b"error")
    ),
    responses_error_event,
    tail=48,
)
