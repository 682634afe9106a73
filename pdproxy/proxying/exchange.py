"""What one client request is, and what goes back to the client; free of any web framework."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdproxy.flow.ticket import DEFAULT_TICKET, Ticket
from pdproxy.proxying.relay import ClientStream
from pdproxy.types import ApiKind


@dataclass(frozen=True, slots=True)
class ClientRequest:
    kind: ApiKind
    body: Mapping[str, Any]  # parsed once; never mutated
    request_id: str | None  # the client's X-Request-Id header, unvalidated
    authorization: str | None
    session: str | None = None  # the --session-header's value (consistent-hash key)
    via: str | None = None  # the Via its legs carry: the client's hops, then this pdproxy's
    ticket: Ticket = DEFAULT_TICKET  # flow control's view: its legs wait for room by it


@dataclass(slots=True)
class ProxyResponse:
    """What goes back to the client: a whole body, or a stream that must be closed."""

    status: int
    content_type: str
    request_id: str
    body: bytes = b""
    stream: ClientStream | None = None
    headers: tuple[tuple[bytes, bytes], ...] = ()  # the engine's own, relayed (pass-through)
