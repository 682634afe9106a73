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

It reads uvicorn's ``RequestResponseCycle`` (``transport``, ``flow``, ``disconnected``,
``chunked_encoding``, ``response_complete``): tests/faults/test_direct_relay.py checks
the fast path is taken with the installed uvicorn, so an upgrade that changes them is seen.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import Send
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle


def direct_writer(send: Send) -> Callable[[bytes], bool] | None:
    """A chunk writer into ``send``'s connection, or None where only ``send`` may write.
    Call it once the response's start has been sent."""
    cycle = getattr(send, "__self__", None)
    if (
        type(cycle) is not RequestResponseCycle
        or cycle.chunked_encoding is not True
        or cycle.response_complete
        or cycle.disconnected
    ):
        return None
    transport, flow = cycle.transport, cycle.flow

    def write(chunk: bytes) -> bool:
        if flow.write_paused or cycle.disconnected:
            return False
        transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        return True

    return write
