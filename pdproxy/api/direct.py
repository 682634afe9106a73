"""A stream's chunks written straight into the client's connection, below ASGI.

Through ASGI every streamed token costs a future resolved by the engine connection's
callback, a task step through the relay's coroutines, a message dict and uvicorn's ``send``
coroutine: about as much Python as the rest of the token's path. ``direct_writer`` returns,
for a response uvicorn's httptools protocol has started with chunked encoding, a function
that writes one chunk in its chunked framing into that connection's transport, called from
the engine connection's own callback (``StreamRelay.relay_directly``).

It declines (returns False) whenever ``send`` would have had something to do: the client's
socket is full (uvicorn's flow control paused writing: ``send`` would await the drain) or
the client is gone. The relay then goes back to ``send`` for that chunk and what follows, so
back-pressure, disconnects, the stream watchdog, a drain's error events and the response's
end all stay on uvicorn's own path. Any other server, protocol or framing gets None: the
ASGI path.

``send_together`` sends a response's start and its first body message (a whole answer's
body, a stream's first chunk) as one write into that connection: the head alone would cost
a write, a segment and a wake-up of the client of its own, for bytes the client cannot use
without the body that follows at once.

``when_lost`` hands pdproxy's client protocol (``runtime.listener.HardenedProtocol``) a
callback for the connection's loss while the response is unfinished: the handler learns of
a client that left without a task of its own waiting in ``receive``.

It reads uvicorn's private ``RequestResponseCycle`` (``CYCLE_FIELDS``, and its flow
control's ``write_paused``), looked up at each stream's start, never imported: a uvicorn
that moves or reshapes it costs the fast path, never the start or a stream (the server logs
``fast_path_problem`` once at start). pyproject bounds uvicorn to the versions tested, and
tests/hostile/test_direct_relay_uvicorn.py fails when the installed one stops offering it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from starlette.types import Message, Send

CYCLE_MODULE = "uvicorn.protocols.http.httptools_impl"
CYCLE_CLASS = "RequestResponseCycle"
CYCLE_FIELDS = ("transport", "flow", "disconnected", "chunked_encoding", "response_complete")
FLOW_MODULE = "uvicorn.protocols.http.flow_control"


def cycle_class(module: str = CYCLE_MODULE, name: str = CYCLE_CLASS) -> type | None:
    """uvicorn's request/response cycle class as now loaded, or None (not loaded, moved)."""
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else None


def direct_writer(send: Send) -> Callable[[bytes], bool] | None:
    """A chunk writer into ``send``'s connection, or None where only ``send`` may write.
    Call it once the response's start has been sent."""
    cycle: Any = getattr(send, "__self__", None)
    if not _is_cycle(cycle):
        return None
    try:
        if cycle.chunked_encoding is not True or cycle.response_complete or cycle.disconnected:
            return None
        transport, flow = cycle.transport, cycle.flow
        flow.write_paused  # noqa: B018  (each chunk reads it: a uvicorn without it is no fast path)
    except AttributeError:
        return None

    def write(chunk: bytes) -> bool:
        if flow.write_paused or cycle.disconnected:
            return False
        transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        return True

    return write


async def send_together(send: Send, start: Message, body: Message) -> None:
    """``send(start)`` then ``send(body)``, their bytes written to the client as one (uvicorn's
    cycle, as ``direct_writer``), else two plain sends. uvicorn's own code frames both and
    keeps its state; only its transport is lent a ``_Held`` for the two calls."""
    cycle: Any = getattr(send, "__self__", None)
    transport = getattr(cycle, "transport", None) if _is_cycle(cycle) else None
    if transport is None:
        await send(start)
        await send(body)
        return
    held = cycle.transport = _Held(transport)
    try:
        await send(start)
        await send(body)
    finally:
        if cycle.transport is held:
            cycle.transport = transport
        held.flush()


class _Held:
    """A transport whose writes wait for ``flush`` (then one write); any other use (a
    close, a look at its state) writes them first, so nothing is reordered or lost."""

    __slots__ = ("_parts", "_transport")

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        self._parts.append(data)

    def flush(self) -> None:
        parts = self._parts
        if parts:
            data = parts[0] if len(parts) == 1 else b"".join(parts)
            parts.clear()
            self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        self.flush()
        return getattr(self._transport, name)


# Set on each cycle by the protocol that calls it (None until a handler asks): a cycle
# without it belongs to a protocol that would never call the callback.
LOST_HOOK = "pdproxy_when_lost"


def when_lost(send: Send, callback: Callable[[], None]) -> bool:
    """Have ``callback`` called when the client's connection is lost before the response
    is complete; False where the connection's protocol cannot (read ``receive`` instead)."""
    cycle: Any = getattr(send, "__self__", None)
    if not _is_cycle(cycle) or getattr(cycle, LOST_HOOK, False) is not None:
        return False
    setattr(cycle, LOST_HOOK, callback)
    return True


def _is_cycle(candidate: object) -> bool:
    """Exactly uvicorn's class (a subclass may change what the fields mean)."""
    return candidate is not None and type(candidate) is cycle_class()


def fast_path_problem(module: str = CYCLE_MODULE, name: str = CYCLE_CLASS) -> str | None:
    """Why the installed uvicorn cannot take the direct relay, or None when it can (as far
    as its code says: the names its cycle and flow control assign)."""
    try:
        importlib.import_module(module)
        flow = importlib.import_module(FLOW_MODULE)
    except ImportError as exc:
        return f"uvicorn has no {exc.name}"
    cls = cycle_class(module, name)
    if cls is None:
        return f"uvicorn's {module} has no {name}"
    missing = [f for f in CYCLE_FIELDS if f not in _assigned(cls)]
    if "write_paused" not in _assigned(getattr(flow, "FlowControl", None)):
        missing.append("flow.write_paused")
    if missing:
        return f"uvicorn's {name} no longer sets {', '.join(missing)}"
    return None


def _assigned(cls: Any) -> tuple[str, ...]:
    """The attribute names ``cls.__init__`` assigns (and any other name its code uses)."""
    code = getattr(getattr(cls, "__init__", None), "__code__", None)
    return tuple(code.co_names) if code is not None else ()
