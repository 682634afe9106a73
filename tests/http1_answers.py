"""Hypothesis strategies for an engine's answer to a leg's request, mostly well formed and
often hostile: status lines (odd versions, reason phrases, codes of 0 to 4 digits), fields
(case, whitespace, obs-fold, duplicates, odd bytes), every framing (Content-Length and its
variants, chunked with extensions and trailers, to the connection's end, both, odd
transfer codings), content codings, interim 1xx answers first, bytes after the message,
and the byte stream cut into random pieces (``exchanges``); and the same answers read
back leniently (``heads``, ``chunk_lines``), for the test's rules.

Each part is drawn by a plain function from strategies built once here (hypothesis spends
most of an example's time building and checking strategies made inside a draw): the tests
stay within a few seconds for hundreds of examples.
"""

from __future__ import annotations

import functools
import gzip
import itertools
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from hypothesis import strategies as st

from tests.http1_reference import Exchange

T = TypeVar("T")
Draw = Callable[[st.SearchStrategy[Any]], Any]  # hypothesis' draw function

_ODDS = {n: st.integers(1, n) for n in (4, 8, 12, 16)}
_CASE = st.integers(0, 3)
_FLIPS = st.integers(0, (1 << 20) - 1)
_BOOL = st.booleans()
_TURNS = st.integers(0, 2)
_RANDOM = st.randoms(use_true_random=False)


def pick(draw: Draw, common: st.SearchStrategy[T], rare: st.SearchStrategy[T], odds: int) -> T:
    """``rare`` once in ``odds``, else ``common``: the well-formed case dominates, so most
    examples reach the body and the reuse of the connection."""
    chosen: T = draw(rare if draw(_ODDS[odds]) == 1 else common)
    return chosen


def _one(*values: T) -> st.SearchStrategy[T]:
    return st.sampled_from(values)


# --- the status line ---

_VERSION = st.just(b"HTTP/1.1")
_ODD_VERSION = _one(b"HTTP/1.0", b"HTTP/1.2", b"HTTP/2.0", b"HTTP/0.9", b"http/1.1", b"HTTP/11")
_CODE = _one(b"200", b"200", b"201", b"400", b"404", b"429", b"500", b"503")
_ODD_CODE = st.one_of(
    st.integers(0, 999).map(lambda n: b"%03d" % n),
    _one(b"204", b"304", b"000", b"099", b"600", b"999", b"20", b"2000", b"+20"),
    _one(b" 200", b"2a0", "٢٠٠".encode(), b"-20"),
)
_INTERIM = _one(b"100", b"103", b"102")
_ODD_INTERIM = _one(b"101", b"199", b"150")
_REASON = _one(b" OK", b" Whatever")
_ODD_REASON = _one(b"", b" ", b" Odd\treason", b" caf\xe9", b" a\x01b", b" OK OK OK")
_CRLF, _LF = st.just(b"\r\n"), st.just(b"\n")
_EOL = {b"\r\n": _CRLF, b"\n": _LF}


def status_line(
    draw: Draw, codes: st.SearchStrategy[bytes], odd: st.SearchStrategy[bytes]
) -> bytes:
    version = pick(draw, _VERSION, _ODD_VERSION, 12)
    return version + b" " + pick(draw, codes, odd, 8) + pick(draw, _REASON, _ODD_REASON, 12)


# --- fields ---

_NAME = _one(b"Content-Type", b"Server", b"X-Request-Id", b"Date", b"Vary", b"Cache-Control")
_VALUE = _one(b"application/json", b"vllm", b"abc-123", b"Mon, 01 Jan 2024 00:00:00 GMT", b"*")
_ODD_VALUE = _one(b"", b"caf\xe9", b"a\x01b", b"a\x00b", b"a\x7fb", b"a\rb", b"  padded  ")
_SEPARATOR = st.just(b": ")
_ODD_SEPARATOR = _one(b":", b":\t", b":   ", b" : ", b" ", b"\t:")
_FOLD = _one(b" ", b"\t")
_CONNECTION = _one(b"keep-alive", b"close", b"Keep-Alive", b"upgrade", b"close, keep-alive")
_COUNT = st.integers(0, 4)


def cased(draw: Draw, name: bytes) -> bytes:
    """``name`` as written, lower, upper, or in a random case."""
    style = draw(_CASE)
    if style == 1:
        return name.lower()
    if style == 2:
        return name.upper()
    if style == 3:
        flips = draw(_FLIPS)
        return bytes(c ^ 32 if flips >> i & 1 and 64 < c < 123 else c for i, c in enumerate(name))
    return name


def field(draw: Draw, name: bytes, value: bytes, eol: bytes) -> bytes:
    """One field line (no line end), its separator odd at times, folded at times."""
    line = cased(draw, name) + pick(draw, _SEPARATOR, _ODD_SEPARATOR, 8) + value
    if draw(_ODDS[16]) == 1:
        line += eol + draw(_FOLD) + b"folded"  # obs-fold
    return line


def other_fields(draw: Draw, eol: bytes) -> list[bytes]:
    lines = [
        field(draw, draw(_NAME), pick(draw, _VALUE, _ODD_VALUE, 8), eol)
        for _ in range(draw(_COUNT))
    ]
    if draw(_ODDS[4]) == 1:
        lines.append(field(draw, b"Connection", draw(_CONNECTION), eol))
    return lines


# --- bodies, content codings and framing ---

_BODY = st.binary(max_size=48)
_ODD_BODY = st.one_of(
    st.integers(1, 4).map(lambda k: b"x" * (k * 100_000)), st.binary(max_size=300)
)
_CODING = _one(b"gzip", b"deflate", b"x-gzip", b"GZIP", b"identity", b"br", b"gzip, gzip")
_DAMAGE = _one(b"cut", b"junk")
_NONE = st.just(b"")


def content_coding(draw: Draw, body: bytes, eol: bytes) -> tuple[list[bytes], bytes]:
    """Mostly none; else a ``Content-Encoding`` and the body coded by it (now and then cut
    short or with bytes after the coded stream)."""
    if draw(_ODDS[8]) != 1:
        return [], body
    coding = draw(_CODING)
    if coding.lower() in (b"gzip", b"x-gzip"):
        body = gzip.compress(body, mtime=0)
    elif coding == b"deflate":
        body = zlib.compress(body)
    damage = pick(draw, _NONE, _DAMAGE, 8)
    if damage == b"cut":
        body = body[:-3]
    elif damage == b"junk":
        body += b"junk"
    return [field(draw, b"Content-Encoding", coding, eol)], body


# Content-Length as sent (%d: the body's length), one field or several
_LENGTH = st.just([b"%d"])
_ODD_LENGTH = _one(
    *[[b"%d"], [b"0%d"], [b"%d "], [b"%d, %d"], [b"%d,%d"], [b"+%d"], [b"-%d"], [b""]],
    *[[b"0x%d"], [b"%d", b"%d"], [b"%d", b"%d1"], [b"99999999999999999999999"]],
    *[[b"%d1"], [b"1%d"]],
)
_TRANSFER_CODINGS = _one(
    *[[b"Chunked"], [b"CHUNKED"], [b"chunked "], [b"gzip, chunked"], [b"chunked, gzip"]],
    *[[b"identity, chunked"], [b"foo"], [b"chunked, chunked"], [b"chunked", b"chunked"]],
    *[[b"gzip", b"chunked"], [b"chunked;q=1"]],
)
_FRAMING = _one("length", "length", "chunked", "chunked", "close", "odd")


def content_length(draw: Draw, body: bytes, eol: bytes) -> list[bytes]:
    forms = pick(draw, _LENGTH, _ODD_LENGTH, 8)
    n = b"%d" % len(body)
    return [field(draw, b"Content-Length", f.replace(b"%d", n), eol) for f in forms]


_CUTS = st.lists(st.integers(0, 1 << 20), max_size=4, unique=True)
_SIZE = _one(b"%x", b"%X", b"000%x")
_ODD_SIZE = _one(b"+1", b"-1", b"0x1", b"ffffffffffffffff")
_EXT = _one(b";a=b", b';a="q;x"', b" ;a", b";", b";a b")
_ODD_END = _one(b"", b"x\r\n", b"\r\n\r\n")
_LAST = st.just(b"0")
_ODD_LAST = _one(b"000", b"0;done", b"00000000000000000000")
_TRAILERS = st.lists(
    _one(b"X-Trailer: t", b"Server-Timing: x;dur=1", b"Content-Length: 5", b"Bad Trailer"),
    max_size=2,
)
_NO_TRAILERS: st.SearchStrategy[list[bytes]] = st.just([])


def chunked_body(draw: Draw, body: bytes, eol: bytes) -> bytes:
    """``body`` in chunks (sizes in any case, zero-padded at times, with extensions), a last
    chunk, trailers; now and then a chunk whose size lies or whose line end is missing."""
    cuts = sorted({c % (len(body) + 1) for c in draw(_CUTS)})
    parts = [body[a:b] for a, b in itertools.pairwise([0, *cuts, len(body)]) if b > a]
    out = []
    for part in parts:
        size = draw(_SIZE) % len(part)
        if draw(_ODDS[16]) == 1:
            size = b"%x" % (len(part) + 1) if draw(_BOOL) else draw(_ODD_SIZE)
        ext = pick(draw, _NONE, _EXT, 8)
        end = pick(draw, _EOL[eol], _ODD_END, 8)
        out.append(size + ext + eol + part + end)
    last = pick(draw, _LAST, _ODD_LAST, 8)
    trailers = pick(draw, _NO_TRAILERS, _TRAILERS, 4)
    out.append(last + eol + b"".join(t + eol for t in trailers) + eol)
    return b"".join(out)


def framing(draw: Draw, body: bytes, eol: bytes) -> tuple[list[bytes], bytes]:
    """The framing fields and the body as sent."""
    kind = draw(_FRAMING)
    if kind == "length":
        return content_length(draw, body, eol), body
    if kind == "close":
        return [], body
    fields = [field(draw, b"Transfer-Encoding", b"chunked", eol)]
    if kind == "odd":
        fields = [field(draw, b"Transfer-Encoding", c, eol) for c in draw(_TRANSFER_CODINGS)]
        if draw(_BOOL):
            fields += content_length(draw, body, eol)
    return fields, chunked_body(draw, body, eol)


# --- the answer: interim heads, the final one, its body, what follows ---

_INTERIM_FIELDS = st.lists(
    _one(b"Link: </s.css>; rel=preload", b"Content-Length: 3", b"X-A: 1"), max_size=2
)
_INTERIM_COUNT = st.integers(1, 2)
_AFTER = _one(b"garbage", b"HTT", b"\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx")


def interims(draw: Draw, eol: bytes) -> bytes:
    if draw(_ODDS[8]) != 1:
        return b""
    heads = []
    for _ in range(draw(_INTERIM_COUNT)):
        lines = [status_line(draw, _INTERIM, _ODD_INTERIM), *draw(_INTERIM_FIELDS)]
        heads.append(b"".join(line + eol for line in lines) + eol)
    return b"".join(heads)


def answer(draw: Draw) -> bytes:
    """The bytes an engine sends."""
    eol = pick(draw, _CRLF, _LF, 16)
    first = interims(draw, eol)
    line = status_line(draw, _CODE, _ODD_CODE)
    coding_fields, body = content_coding(draw, pick(draw, _BODY, _ODD_BODY, 8), eol)
    framing_fields, sent = framing(draw, body, eol)
    fields = coding_fields + framing_fields + other_fields(draw, eol)
    draw(_RANDOM).shuffle(fields)
    head = line + eol + b"".join(f + eol for f in fields) + eol
    return first + head + sent + pick(draw, _NONE, _AFTER, 8)


_PIECE_CUTS = st.lists(st.integers(1, 1 << 20), max_size=6, unique=True)
_METHOD: st.SearchStrategy[Literal["POST", "GET"]] = st.just("POST")
_ODD_METHOD: st.SearchStrategy[Literal["POST", "GET"]] = st.just("GET")


def pieces(draw: Draw, data: bytes) -> tuple[tuple[bytes, ...], tuple[int, ...]]:
    """``data`` cut at random places, each piece followed by 0 to 2 loop turns."""
    cuts = sorted({c % len(data) for c in draw(_PIECE_CUTS)} - {0}) if data else []
    bounds = [0, *cuts, len(data)]
    cut = tuple(data[a:b] for a, b in itertools.pairwise(bounds) if b > a)
    return cut, tuple(draw(_TURNS) for _ in cut)


@st.composite
def exchanges(draw: Draw) -> Exchange:
    """An answer to a POST (one in eight: to a GET), in pieces, the connection closed
    after it or not."""
    data = answer(draw)
    cut, turns = pieces(draw, data)
    close = draw(_BOOL)
    return Exchange(cut, turns, close, pick(draw, _METHOD, _ODD_METHOD, 8))


# --- reading an answer back, leniently: for the rules of the test, never for its verdict ---


@dataclass(frozen=True)
class Head:
    """One head as sent: its lines (the status line first, folded lines apart), whether a
    line ended in a lone LF, and its length up to the empty line."""

    lines: tuple[bytes, ...]
    bare_lf: bool
    size: int
    complete: bool  # its empty line came

    @property
    def version(self) -> bytes:
        return self.lines[0].split(b" ", 1)[0]

    @property
    def interim(self) -> bool:
        """A 1xx that is skipped (101 is not: it would end HTTP/1.1 on the connection)."""
        code = self.code
        return code is not None and 100 <= code < 200 and code != 101

    @property
    def code(self) -> int | None:
        parts = self.lines[0].split(b" ", 2)
        ok = len(parts) > 1 and re.fullmatch(rb"[0-9]{3}", parts[1])
        return int(parts[1]) if ok else None

    def values(self, name: bytes) -> list[bytes]:
        """The values of field ``name`` (any case), each split at commas."""
        found = []
        for line in self.lines[1:]:
            field, colon, value = line.partition(b":")
            if colon and field.strip().lower() == name:
                found += [v.strip() for v in value.split(b",")]
        return found


_SCAN = 256 * 1024  # a head read this far is over any cap: the rest is not looked at


@functools.lru_cache(maxsize=4)  # every rule asks, and a seed's head may be megabytes
def heads(data: bytes) -> tuple[tuple[Head, ...], int]:
    """The interim heads and the final one (or the unfinished one), and where its body
    starts."""
    found: list[Head] = []
    pos = 0
    while True:
        lines, start = [], pos
        bare_lf = complete = False
        while (end := data.find(b"\n", pos)) >= 0 and pos - start < _SCAN:
            line, pos = data[pos:end], end + 1
            bare_lf |= not line.endswith(b"\r")
            if not line.rstrip(b"\r"):
                complete = True
                break
            lines.append(line.rstrip(b"\r"))
        else:
            pos = len(data)
        if not lines:
            return tuple(found), pos
        head = Head(tuple(lines), bare_lf, pos - start, complete)
        found.append(head)
        if not head.interim:
            return tuple(found), pos


@dataclass(frozen=True)
class Chunks:
    """What a chunked body announces, read as far as it is sane: each chunk's (size,
    extensions), where its trailers start (None if no last chunk came) and the body bytes
    that arrived."""

    lines: list[tuple[int, bytes]]
    trailers: int | None
    received: bytes


def chunk_lines(data: bytes, pos: int) -> Chunks:
    found: list[tuple[int, bytes]] = []
    received: list[bytes] = []
    while (end := data.find(b"\n", pos)) >= 0:
        match = re.match(rb"([0-9a-fA-F]+)(.*?)\r?$", data[pos:end], re.S)
        if not match:
            break
        size = int(match.group(1), 16)
        found.append((size, match.group(2)))
        if size == 0:
            return Chunks(found, end + 1, b"".join(received))
        received.append(data[end + 1 : end + 1 + size])
        if size > len(data):
            break
        pos = end + 1 + size + 2
    return Chunks(found, None, b"".join(received))


def chunked_start(exchange: Exchange) -> int | None:
    """Where the final answer's chunked body starts, if it says it is chunked."""
    found, start = heads(exchange.data)
    return start if found and found[-1].values(b"transfer-encoding") else None


def final_head(exchange: Exchange) -> Head | None:
    found, _ = heads(exchange.data)
    return found[-1] if found else None
