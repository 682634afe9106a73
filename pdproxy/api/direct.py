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

from starlette.types import Send

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
