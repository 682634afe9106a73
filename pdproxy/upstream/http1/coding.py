"""Decoding a gzip or deflate body (``Content-Encoding``), a bounded piece at a time.

pdproxy sends no ``Accept-Encoding``, so a coded answer is the engine's own choice (or a
gateway's in front of it). Relaying it with its header is no option: pdproxy reads a
prefill's JSON and a stream's end marker, and its answers are built from the bytes. So the
body is decoded here; any other coding is refused. Each call hands out at most ``PIECE``
decoded bytes, keeping the rest of its input, so a small coded body that inflates to
gigabytes (a zip bomb) costs at most one piece of memory per read and meets the body cap
of a buffered answer as it grows.
"""

from __future__ import annotations

import zlib

from pdproxy.upstream.http1.errors import MalformedResponse

PIECE = 256 * 1024  # decoded bytes handed out per call
# zlib's window bits: 16 + 15 reads the gzip wrapper, 32 + 15 either gzip or zlib's (the
# "deflate" coding is zlib-wrapped by RFC 9110, though some servers send it raw).
_WBITS = {
    "gzip": 16 + zlib.MAX_WBITS,
    "x-gzip": 16 + zlib.MAX_WBITS,
    "deflate": 32 + zlib.MAX_WBITS,
}
_IDENTITY = ("", "identity")


def decoder_for(coding: str | None) -> Decoder | None:
    """None for an uncoded body; a ``Decoder`` for gzip or deflate; ``MalformedResponse``
    for anything else (br, zstd, compress, or codings stacked)."""
    if coding is None:
        return None
    name = coding.strip().lower()
    if name in _IDENTITY:
        return None
    wbits = _WBITS.get(name)
    if wbits is None:
        raise MalformedResponse("the answer's content coding is not gzip or deflate")
    return Decoder(wbits)


class Decoder:
    """One coded body's decoder; ``decode`` until the body ends, then ``finish``."""

    __slots__ = ("_fed", "_zlib")

    def __init__(self, wbits: int) -> None:
        self._zlib = zlib.decompressobj(wbits)
        self._fed = False

    @property
    def pending(self) -> bool:
        """Input is left that may decode to more (call ``decode(b"")``)."""
        return bool(self._zlib.unconsumed_tail)

    def decode(self, data: bytes) -> bytes:
        """At most ``PIECE`` decoded bytes of what was fed so far and ``data``."""
        z = self._zlib
        tail = z.unconsumed_tail
        self._fed = self._fed or bool(data)
        try:
            return z.decompress(tail + data if tail else data, PIECE)
        except zlib.error as exc:
            raise MalformedResponse("the answer's coded body does not decode") from exc

    def finish(self) -> None:
        """The body ended: it must have ended the coded stream, with nothing after it (or
        been empty: a 204's ``Content-Encoding`` codes no bytes)."""
        z = self._zlib
        if not self._fed:
            return
        if not z.eof or z.unused_data or z.unconsumed_tail:
            raise MalformedResponse("the answer's coded body is cut short or has bytes after it")
