"""One keep-alive connection to an engine: an asyncio protocol on httptools' parser.

It reads one answer per request as RFC 9112 frames it, with the caps aiohttp's client has
(docs/security.md, "Engine answers"):

* interim ``1xx`` answers are skipped (their heads capped like any other); ``101`` is
  refused, pdproxy never asks to upgrade; a status outside 100-599 (``000`` included) is
  malformed;
* a head: each line at most ``MAX_LINE`` bytes, at most ``MAX_FIELDS`` fields, at most
  ``MAX_HEAD`` bytes in all; bytes that are no body (heads, chunk framing, trailers) at
  most ``MAX_HEAD`` in a row, counted as they arrive, so an endless header is refused
  after one read past the cap, never buffered whole;
* a chunked body's sizes are read from the raw bytes before the parser takes them
  (``chunks.ChunkSizes``): a size over the body cap is malformed before any byte after it
  is handed on;
* trailers are counted and dropped, never kept for the next answer;
* a byte after the answer's end makes the connection unusable (closed), so it can never
  be read as the next request's answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools

from pdproxy.upstream.http1.chunks import BadChunkLine, ChunkSizes
from pdproxy.upstream.http1.errors import ConnectionBroken, HTTPError, MalformedResponse
from pdproxy.upstream.http1.response import HIGH_WATER, Response

MAX_LINE = 8190  # aiohttp's max_line_size / max_field_size
MAX_FIELDS = 128  # aiohttp's max_headers
MAX_HEAD = 64 * 1024
_FRAMING = (b"content-length", b"transfer-encoding")


class Owner(Protocol):
    """The pool a connection belongs to."""

    loop: asyncio.AbstractEventLoop

    def release(self, connection: Connection) -> None: ...

    def discard(self, connection: Connection) -> None: ...

    def lost(self, connection: Connection) -> None: ...


class Target:
    __slots__ = ("head", "host", "key", "port", "tls")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.key = (self.tls, self.host, self.port)
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        host = f"[{self.host}]" if ":" in self.host else self.host  # IPv6
        if parts.port:
            host += f":{parts.port}"
        self.head = f" {target} HTTP/1.1\r\nHost: {host}\r\n"  # never the URL's userinfo


class Connection(asyncio.Protocol):
    """One connection to an engine, one request at a time."""

    def __init__(self, pool: Owner, key: tuple[bool, str, int]) -> None:
        self.pool = pool
        self.key = key
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.response: Response | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._pushed: list[bytes] = []  # body pieces of this read, for the response's sink
        # the message being parsed (reset as each begins)
        self._fields: list[tuple[bytes, bytes]] = []
        self._field_count = 0  # its fields, or its trailers once its head is done
        self._head_size = 0  # bytes of its head (or of its trailers)
        self._in_head = True
        self._interim = False  # a 1xx, skipped
        self._dry = 0  # bytes read in a row with no body byte among them
        self._head_pending = True  # the answer's final head not yet parsed
        self._head_tail = b""  # the last bytes of a head's read, for an end split by reads
        self._head_start = b""  # the first bytes of a head (its status's first digit)
        self._split = False  # a feed that ends where a head should
        self._chunk_sizes: ChunkSizes | None = None  # a chunked body's framing, read ahead
        self._poll: select.poll | None = None  # the socket, to look at it while idle
        self._pollable = hasattr(select, "poll")  # false: the OS gives no way (Windows)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None or response.complete:  # nothing was asked: unusable
            self.close()
            return
        buffered, size = response._buffered, len(data)
        try:
            if self._head_pending:
                data = self._through_heads(data)
            if self._chunk_sizes is not None:  # once per streamed token: checked, then fed
                self._chunk_sizes.check(data)
            self._parser.feed_data(data)
        except BadChunkLine as exc:  # the bytes before the line, none after
            self._feed_before(data[: exc.at], response, exc)
            return
        except httptools.HttpParserError as exc:
            cause = exc.__context__  # what a callback of ours raised
            error = cause if isinstance(cause, HTTPError) else None
            self._refuse(response, error or MalformedResponse(f"malformed HTTP answer ({exc})"))
            return
        if self._pushed:
            self._offer_pushed(response)
            self._dry = 0
        elif response._buffered != buffered:
            self._dry = 0
        else:  # no body in this read: a head, chunk framing or trailers
            self._dry += size
            if self._dry > MAX_HEAD and not response.complete:
                self._refuse(response, MalformedResponse(f"a head over {MAX_HEAD} bytes"))

    def _through_heads(self, data: bytes) -> bytes:
        """Feed the parser up to the end of the answer's final head, if it ends in
        ``data`` (llhttp is strict: a head ends at its first empty CRLF line; an interim
        1xx head is fed with what follows it, as one read), so that a chunked body's framing
        is read from its first byte; what is left of ``data``, for the caller to check and
        feed."""
        at = 0  # data[:at]: interim heads, fed with the rest
        while self._head_pending:
            tail = self._head_tail
            seek = tail + data[at:] if tail else data[at:]
            if len(self._head_start) < 10:
                self._head_start += data[at : at + 10 - len(self._head_start)]
            mark = seek.find(b"\r\n\r\n")
            if mark < 0:
                self._head_tail = seek[-3:]
                return data
            cut = at + mark + 4 - len(tail)
            interim = self._head_start[9:10] == b"1"  # "HTTP/1.1 1xx"
            self._head_tail = self._head_start = b""
            if not interim:
                self._split = True  # the final head ends where this feed does
                try:
                    self._parser.feed_data(data[:cut])
                finally:
                    self._split = False
                data, cut = data[cut:], 0
            at = cut
            if at >= len(data):
                break
        return data

    def _feed_before(self, data: bytes, response: Response, error: BadChunkLine) -> None:
        """Parse what came before a bad chunk size line (whole chunks, handed on), then
        refuse the answer."""
        if data:  # a parser error there: the answer is refused for its size line anyway
            with contextlib.suppress(httptools.HttpParserError):
                self._parser.feed_data(data)
        self._refuse(response, error)

    def _refuse(self, response: Response, error: HTTPError) -> None:
        """The answer is unusable from here: what came of its body is handed on, then the
        error; the connection is closed (nothing after it can be trusted)."""
        if self._pushed:
            self._offer_pushed(response)
        response._fail(error)
        self.close()

    def _offer_pushed(self, response: Response) -> None:
        """The body pieces this read brought, joined, to the sink: one write for the tokens
        of one read, as ``read_chunk`` joins them; buffered if it declines."""
        pushed = self._pushed
        data = pushed[0] if len(pushed) == 1 else b"".join(pushed)
        pushed.clear()
        sink = response._sink
        if sink is None or not sink(data):
            response._feed(data)

    def eof_received(self) -> bool:
        response = self.response
        if response is not None and response.status and not response._framed:
            response._keep_alive = False
            response._finish()  # a body delimited by the connection's end
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response = self.response
        if response is not None:
            error = ConnectionBroken("the engine closed the connection before answering whole")
            error.__cause__ = exc
            response._fail(error)
        self.pool.lost(self)

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def send(self, data: bytes, response: Response) -> None:
        if self.transport is None:
            raise ConnectionBroken("the connection has no transport")
        self.response = response
        self._dry = 0
        self.transport.write(data)

    def quiet(self) -> bool:
        """An idle connection is fit for a next request: open, and (where the OS lets us
        look) nothing has arrived on its socket, neither bytes nor the engine's close,
        that the loop has not read yet. One poll(2) of the socket, kept registered."""
        transport = self.transport
        if self.closed or transport is None or transport.is_closing():
            return False
        poll = self._poll
        if poll is None:
            if not self._pollable:
                return True
            sock = transport.get_extra_info("socket")
            fileno = sock.fileno() if sock is not None else -1
            if fileno < 0:  # no socket to look at (a test's transport)
                self._pollable = False
                return True
            poll = self._poll = select.poll()
            poll.register(fileno, select.POLLIN)
        return not poll.poll(0)  # readable while idle: bytes, an end or an error

    # --- httptools callbacks ---

    def on_message_begin(self) -> None:
        response = self.response
        if response is None or response.complete:  # bytes after the answer
            raise MalformedResponse("bytes after the end of the answer")
        self._fields = []
        self._field_count = self._head_size = 0
        self._in_head = True
        self._interim = False

    def on_status(self, reason: bytes) -> None:
        self._head_size += len(reason)
        if self._head_size > MAX_LINE:
            raise MalformedResponse(f"a status line over {MAX_LINE} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value) + 4  # ": " and CRLF
        self._head_size += size
        self._field_count += 1
        if size > MAX_LINE:
            raise MalformedResponse(f"a header line over {MAX_LINE} bytes")
        if self._field_count > MAX_FIELDS:
            raise MalformedResponse(f"over {MAX_FIELDS} header fields")
        if self._head_size > MAX_HEAD:
            raise MalformedResponse(f"a head over {MAX_HEAD} bytes")
        if self._in_head:  # else a trailer: counted, never kept
            self._fields.append((name, value))

    def on_headers_complete(self) -> None:
        response = self.response
        if response is None:  # data_received never feeds without one
            raise MalformedResponse("an answer to no request")
        fields = self._fields
        self._fields = []
        self._field_count = self._head_size = 0  # the trailers' own budget
        self._in_head = False
        parser = self._parser
        status = parser.get_status_code()
        if 100 <= status < 200:
            self._interim_head(status, fields)
        elif 200 <= status < 600:
            self._head_pending = False
            if self._split and _chunked(fields):  # else framing unknown: capped as it comes
                self._chunk_sizes = ChunkSizes(response._limit)
            response._headers_done(status, fields, parser.should_keep_alive())
        else:
            raise MalformedResponse(f"status {status:03d} is not an HTTP status")

    def _interim_head(self, status: int, fields: list[tuple[bytes, bytes]]) -> None:
        """A 1xx: skipped (the final answer follows), unless it cannot be one."""
        if status == 101:
            raise MalformedResponse("101 Switching Protocols, but pdproxy never asks to upgrade")
        if any(name.lower() in _FRAMING for name, _ in fields):
            raise MalformedResponse(f"an interim {status} answer with a body")
        self._interim = True

    def on_body(self, body: bytes) -> None:
        response = self.response
        if response is not None:  # Response._feed, inlined: once per streamed token
            if response._sink is not None and not response._chunks:
                self._pushed.append(body)  # offered once the whole read is parsed
                return
            response._chunks.append(body)
            response._buffered += len(body)
            if response._buffered > HIGH_WATER:
                self.pause_reading()
            waiter = response._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self._head_pending = True  # the next answer's
        self._chunk_sizes = None
        if self.response is not None:
            self.response._finish()


def _chunked(fields: list[tuple[bytes, bytes]]) -> bool:
    """Whether the head frames its body in chunks (its last transfer coding), as llhttp."""
    codings = [v for name, v in fields if name.lower() == b"transfer-encoding"]
    return bool(codings) and codings[-1].rsplit(b",", 1)[-1].strip().lower() == b"chunked"
