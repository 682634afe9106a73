"""The OpenAI generation endpoints as raw ASGI handlers (the hot path).

They skip FastAPI's dependency machinery: the body is read once with a size cap, parsed
once with orjson, and the orchestrator's response is streamed straight into ``send``. A
client disconnect cancels the work (vLLM's ``with_cancellation`` pattern), which closes
both upstream legs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import Message, Receive, Scope, Send

from pdproxy.api.access import RequestFinisher
from pdproxy.api.direct import direct_writer, send_together, when_lost
from pdproxy.api.errors import error_body, internal_error
from pdproxy.api.flow import ticket_for
from pdproxy.api.request_body import ClientGone, parse_body, read_json_body
from pdproxy.api.state import AppState
from pdproxy.errors import (
    LoopDetected,
    Overloaded,
    ProxyError,
    ShuttingDown,
    Unauthorized,
)
from pdproxy.flow.ticket import DEFAULT_TICKET, Ticket
from pdproxy.observability.request_context import RequestTrace, bind, unbind
from pdproxy.proxying.exchange import ClientRequest, ProxyResponse
from pdproxy.proxying.framing import SSE_DONE
from pdproxy.proxying.lifecycle import Lifecycle
from pdproxy.proxying.relay import ClientStream
from pdproxy.types import ApiKind
from pdproxy.wire.hop import Hop
from pdproxy.wire.shaping import REQUEST_ID_KEY

logger = logging.getLogger(__name__)

_REQUEST_ID_HEADER = REQUEST_ID_KEY.encode("latin-1")  # on every answer


Answer = Callable[[], Awaitable[ProxyResponse]]
Work = tuple[Answer, Ticket]  # what produces the response, and who the request is


class ServedEndpoint:
    """What every proxied endpoint does around its answer: the in-flight count, the
    request's trace and log context, the loop, key and drain checks, admission,
    disconnects, the OpenAI-shaped error, and the request's end (metrics, span, access
    line)."""

    path: str

    def __init__(self, state: AppState) -> None:
        self._state = state
        self.hop = Hop.of(state.config.hop_id)
        book = state.admission.book if state.admission is not None else None
        self._finish = RequestFinisher(state.metrics, access_log=state.config.access_log, book=book)

    async def answer(self, headers: dict[str, str], receive: Receive) -> Work:
        """Read the request; return what produces its response, and its ticket."""
        raise NotImplementedError

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state = self._state
        state.in_flight.enter()
        headers = _headers(scope)
        path = self.path
        trace = RequestTrace(path, state.tracer.start_request(path, headers))
        token = bind(trace)  # the request's log lines carry its id from here on
        try:
            via = headers.get("via")  # most requests have none: one lookup, no call
            if via is not None and self.hop.returned(via):
                raise LoopDetected("the request came back to this pdproxy: a routing loop")
            _admit(state, headers)
            answer, ticket = await self.answer(headers, receive)
            if ticket is not DEFAULT_TICKET:
                trace.ticket = ticket
            trace.outcome = await _serve(state, answer, receive, send, trace, ticket)
        except ProxyError as error:
            trace.outcome = _outcome(error)
            await _send_error(send, error, trace)
        except ClientGone:
            trace.outcome = "client_disconnected"
        finally:
            state.in_flight.leave()
            self._finish(trace)
            unbind(token)


class GenerationEndpoint(ServedEndpoint):
    """``POST /v1/completions``, ``/v1/chat/completions`` or ``/inference/v1/generate``."""

    def __init__(self, kind: ApiKind, state: AppState) -> None:
        super().__init__(state)
        self.kind = kind
        self.path = kind.value

    async def answer(self, headers: dict[str, str], receive: Receive) -> Work:
        state = self._state
        request = await self._read_request(headers, receive, state)
        ticket = ticket_for(state, request.body, headers)
        if ticket is not DEFAULT_TICKET:
            body = request.body
            if ticket.priority and body.get("priority") != ticket.priority:
                body = {**body, "priority": ticket.priority}  # the tenant's, for both legs
            request = dataclasses.replace(request, body=body, ticket=ticket)
        render_once = state.render_once
        if render_once is not None and self.kind is not ApiKind.GENERATE:
            return functools.partial(render_once.handle, request), ticket
        return functools.partial(state.orchestrator.handle, request), ticket

    async def _read_request(
        self, headers: dict[str, str], receive: Receive, state: AppState
    ) -> ClientRequest:
        raw = await read_json_body(headers, receive, state.config.max_body_bytes)
        body = parse_body(raw, self.kind)
        # With an engine key the client's own never reaches an engine; else it passes through.
        upstream_auth = state.engine_authorization or headers.get("authorization")
        session = headers.get(state.config.scheduling.session_header)
        return ClientRequest(
            self.kind,
            body,
            headers.get(REQUEST_ID_KEY),
            upstream_auth,
            session or None,
            legs_via(self.hop, headers),
        )


def legs_via(hop: Hop, headers: dict[str, str]) -> str:
    """The ``Via`` a request's legs carry (``Hop.forward``, without a call for the usual
    request that has none)."""
    via = headers.get("via")
    return hop.via if via is None else hop.forward(via)


def _admit(state: AppState, headers: dict[str, str]) -> None:
    """Refuse at once when draining (503) or without a valid client key (401)."""
    if state.lifecycle.draining:
        raise ShuttingDown("pdproxy is shutting down; retry on another replica")
    if state.keys.enabled and not state.keys.allows(headers.get("authorization")):
        raise Unauthorized("invalid or missing API key (Authorization: Bearer KEY)")


async def _serve(
    state: AppState,
    answer: Callable[[], Awaitable[ProxyResponse]],
    receive: Receive,
    send: Send,
    trace: RequestTrace,
    ticket: Ticket = DEFAULT_TICKET,
) -> str:
    """Run the request (``answer`` gets its response), cancelling it if the client goes
    away; returns the outcome label. Shared with the pass-through endpoints."""
    task = asyncio.current_task()
    disconnected = _Departure(task, trace)
    # pdproxy's listener says when the client leaves; elsewhere a task waits in receive()
    watcher = None
    if not when_lost(send, disconnected.left):
        watcher = asyncio.create_task(_watch_disconnect(receive, disconnected))
    admitted = False
    try:
        if state.admission is not None:
            await state.admission.acquire(ticket)  # a client that leaves stops waiting
            admitted = True
        response = await _orchestrate(state, answer, send, trace)
        if response is None:
            return "error"
        return await _send_response(send, response, state.lifecycle, trace)
    except asyncio.CancelledError:
        if disconnected.happened:
            _uncancel(task)
            return "client_disconnected"
        if not state.lifecycle.forced:
            raise
        _uncancel(task)  # the drain's grace is over and no answer has started
        error = ShuttingDown("pdproxy shut down before the engines answered")
        await _send_error(send, error, trace)
        return _outcome(error)
    except ProxyError as error:
        await _send_error(send, error, trace)
        return _outcome(error)
    except Exception:
        # The response may have started: nothing more can be said to this client.
        logger.exception("unexpected failure relaying %s", trace.endpoint)
        return "error"
    finally:
        disconnected.settled = True  # the request's end: no cancel from here on
        if watcher is not None:
            watcher.cancel()
        if admitted and state.admission is not None:
            state.admission.release(ticket)


def _uncancel(task: asyncio.Task[Any] | None) -> None:
    if task is not None:
        task.uncancel()


async def _orchestrate(
    state: AppState, answer: Callable[[], Awaitable[ProxyResponse]], send: Send, trace: RequestTrace
) -> ProxyResponse | None:
    """The orchestrator's answer; a proxy bug becomes a generic 500 (and None)."""
    task = asyncio.current_task()
    waiting = state.lifecycle.waiting
    if task is not None:
        waiting.add(task)  # until it answers, a drain past its grace may cancel it
    try:
        return await answer()
    except (ProxyError, asyncio.CancelledError):
        raise
    except Exception:
        logger.exception("unexpected failure serving %s", trace.endpoint)
        await _send_whole(send, trace, *error_body(internal_error()))
        return None
    finally:
        if task is not None:
            waiting.discard(task)


class _Departure:
    """A client that left before its response was whole: its handler is cancelled."""

    __slots__ = ("_task", "_trace", "happened", "settled")

    def __init__(self, task: asyncio.Task[Any] | None, trace: RequestTrace) -> None:
        self._task = task
        self._trace = trace
        self.happened = False
        self.settled = False  # the handler is past its answer: nothing to cancel

    def left(self) -> None:
        if self.settled or self._trace.answered:
            # uvicorn's receive() says "disconnect" as soon as the response is complete:
            # the client got all of it, and the handler is only reading the engine's end
            # of the stream to pool its connection (bounded by the stream watchdog), not
            # to be cut.
            return
        self.happened = True
        if self._task is not None:
            self._task.cancel()


async def _watch_disconnect(receive: Receive, departure: _Departure) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    departure.left()


async def _send_response(
    send: Send, response: ProxyResponse, lifecycle: Lifecycle, trace: RequestTrace
) -> str:
    """Write the response; returns the outcome ("ok", or why a stream ended in error)."""
    headers = [
        (b"content-type", response.content_type.encode("latin-1")),
        (_REQUEST_ID_HEADER, response.request_id.encode("latin-1")),
    ]
    if response.headers:
        headers.extend(response.headers)
    trace.status = response.status
    if response.stream is None:
        headers.append((b"content-length", str(len(response.body)).encode("latin-1")))
        start = {"type": "http.response.start", "status": response.status, "headers": headers}
        trace.answered = True
        await send_together(send, start, {"type": "http.response.body", "body": response.body})
        trace.first_byte, trace.bytes_sent = time.perf_counter(), len(response.body)
        return "ok"
    headers.append((b"cache-control", b"no-cache"))
    lifecycle.streams.add(response.stream)  # a drain past its grace ends it with an error event
    try:
        start = {"type": "http.response.start", "status": response.status, "headers": headers}
        await _send_stream(send, start, response.stream, trace)
    finally:
        lifecycle.streams.discard(response.stream)
        response.stream.close()
    failure = response.stream.failure
    return "ok" if failure is None else _outcome(failure)


async def _send_stream(
    send: Send, start: Message, stream: ClientStream, trace: RequestTrace
) -> None:
    """Relay chunk by chunk; the first goes out with the response's start, in one write
    (``send_together``), and the chunk that ends with ``[DONE]`` also ends the response, so
    neither the head nor the terminator costs a write of its own. Once the response has
    started, where uvicorn allows it, the chunks in between are written straight into the
    client's connection as they arrive (``direct_writer``); this loop wakes again only for
    the last one, a failure, or a full client socket, after which it hands the stream back."""
    chunk = await stream.next_chunk()
    finished = chunk is None or chunk.endswith(SSE_DONE)
    sent = 0 if chunk is None else len(chunk)
    trace.answered = finished
    first = {"type": "http.response.body", "body": chunk or b"", "more_body": not finished}
    try:
        await send_together(send, start, first)
        trace.first_byte = time.perf_counter()
        direct = None if finished else direct_writer(send)
        if direct is not None:
            stream.relay_directly(direct)
        while (chunk := await stream.next_chunk()) is not None:
            if finished:
                continue  # nothing follows [DONE] in vLLM's streams
            finished = chunk.endswith(SSE_DONE)
            trace.answered = finished
            await send({"type": "http.response.body", "body": chunk, "more_body": not finished})
            sent += len(chunk)
            if direct is not None and not finished:
                stream.relay_directly(direct)
        if not finished:
            trace.answered = True
            await send({"type": "http.response.body", "body": b""})
    finally:
        trace.bytes_sent = sent + stream.pushed


async def _send_whole(
    send: Send,
    trace: RequestTrace,
    status: int,
    body: bytes,
    content_type: str,
    extra: tuple[tuple[bytes, bytes], ...] = (),
) -> None:
    headers = [(b"content-type", content_type.encode("latin-1")), *extra]
    trace.status = status
    await send({"type": "http.response.start", "status": status, "headers": headers})
    trace.answered = True
    await send({"type": "http.response.body", "body": body})
    trace.first_byte, trace.bytes_sent = time.perf_counter(), len(body)


async def _send_error(send: Send, error: ProxyError, trace: RequestTrace) -> None:
    extra: tuple[tuple[bytes, bytes], ...] = ()
    if isinstance(error, Overloaded):
        extra = (
            (b"retry-after", str(error.retry_after).encode("latin-1")),
            *((k.encode("latin-1"), v.encode("latin-1")) for k, v in error.headers),
        )
    await _send_whole(send, trace, *error_body(error), extra)


def _headers(scope: Scope) -> dict[str, str]:
    """The request's headers by (lower-case) name; a repeated one's values joined with ", "
    as RFC 9110 §5.3 combines them, so a second ``Via`` line cannot hide pdproxy's hop."""
    headers: dict[str, str] = {}
    for k, v in scope["headers"]:
        name, value = k.decode("latin-1"), v.decode("latin-1")
        if name in headers:
            value = f"{headers[name]}, {value}"
        headers[name] = value
    return headers


def _outcome(error: ProxyError) -> str:
    return type(error).__name__
