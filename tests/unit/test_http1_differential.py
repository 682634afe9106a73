"""The legs' HTTP/1.1 client against a reference parser (issue 19, item 2).

The same engine answers, generated (tests/http1_answers.py) and hostile (``SEEDS``: the
issue's rows 1, 3, 9, 10, 11 and the trailers item), cut into random pieces, are read by
pdproxy's ``http1.Pool`` over an in-memory transport and by h11's client
(tests/http1_reference.py); both must reach the same framing verdict: an error, or a message
with the same final status, body and reuse of the connection (and, when reused, the same
next answer on it). Where pdproxy means to differ from h11, a named rule
(tests/http1_rules.py) says how and why; nothing else is excused. ``KNOWN_DIVERGENCES``
lists what pdproxy still gets wrong, each with a reproducer that must still fail.

``make test`` runs ``DEFAULT_EXAMPLES`` derandomized examples; ``make fuzz`` sets
``PDPROXY_FUZZ_EXAMPLES`` (random examples, a new seed each run).
"""

from __future__ import annotations

import asyncio
import gzip
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import pytest
from hypothesis import HealthCheck, given, settings

from tests.http1_answers import exchanges
from tests.http1_reference import Exchange, Verdict, h11_verdict, pdproxy_verdict
from tests.http1_rules import BODY_CAP, accepted

DEFAULT_EXAMPLES = 300
FUZZ_EXAMPLES = int(os.environ.get("PDPROXY_FUZZ_EXAMPLES", "0"))

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
KV = b'{"kv_transfer_params":{"remote_block_ids":[1,2,3]}}'
KV_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(KV), KV)
CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
MIB = 1 << 20

# --- what pdproxy still gets wrong (each reproducer must still fail, until it is fixed) ---


@dataclass(frozen=True)
class Divergence:
    """An answer pdproxy reads wrongly today: ``why`` says who is right, ``reproducer`` is
    the smallest answer showing it, ``matches`` recognises it among generated answers."""

    name: str
    why: str
    reproducer: Exchange
    matches: Callable[[Exchange, Verdict, Verdict], bool]


KNOWN_DIVERGENCES: tuple[Divergence, ...] = ()


def check(exchange: Exchange, *, excuse_known: bool = True) -> None:
    """pdproxy's verdict is one the rules accept given h11's; a listed divergence is
    excused in generated answers and seeds (its reproducer runs apart, and must fail)."""
    reference = h11_verdict(exchange)
    actual = asyncio.run(pdproxy_verdict(exchange, max_body=BODY_CAP))
    allowed, applied = accepted(exchange, reference)
    if actual in allowed:
        return
    if excuse_known and any(d.matches(exchange, reference, actual) for d in KNOWN_DIVERGENCES):
        return
    pytest.fail(
        f"\n  answer: {exchange.data[:600]!r} ({len(exchange.data)} bytes, in "
        f"{len(exchange.pieces)} pieces{', then closed' if exchange.close else ''}, "
        f"to a {exchange.method})\n  h11:     {reference}\n  pdproxy: {actual}\n"
        f"  rules: {', '.join(applied) or 'none'}",
        pytrace=False,
    )


# --- the seeds: the hostile answers ---

Seed = tuple[str, bytes, bool, Literal["POST", "GET"]]


def seed(name: str, data: bytes, *, close: bool = False, get: bool = False) -> Seed:
    """A hostile answer (to a POST unless ``get``), run whole and in small pieces."""
    return name, data, close, "GET" if get else "POST"


def answer(fields: bytes, body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\n" + fields + b"\r\n" + body


def ok_with(fields: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\n" + fields + OK[17:]


def length(body: bytes, fields: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\n%sContent-Length: %d\r\n\r\n%s" % (fields, len(body), body)


SEEDS: list[Seed] = [
    # row 1: an interim 1xx is not the answer; 101 is refused
    seed("100-continue", b"HTTP/1.1 100 Continue\r\n\r\n" + KV_ANSWER),
    seed("103-early-hints", b"HTTP/1.1 103 Early Hints\r\nLink: </s>\r\n\r\n" + KV_ANSWER),
    seed("100-then-103", b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 EH\r\n\r\n" + OK),
    seed("1xx-with-length", b"HTTP/1.1 103 EH\r\nContent-Length: 5\r\n\r\n" + OK),
    seed("101-switching", b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n" + OK),
    seed("100-then-close", b"HTTP/1.1 100 Continue\r\n\r\n", close=True),
    # row 3: heads without bounds
    seed("1mib-header-line", ok_with(b"X-Big: " + b"a" * MIB + b"\r\n")),
    seed("200k-headers", ok_with(b"X-A: b\r\n" * 200_000)),
    seed("128-fields", ok_with(b"X-A: b\r\n" * 126)),  # with Content-Type and -Length
    seed("129-fields", ok_with(b"X-A: b\r\n" * 127)),
    seed("endless-header-line", b"HTTP/1.1 200 OK\r\nX-Endless: " + b"a" * (4 * MIB)),
    seed("endless-headers", b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 100_000),
    # row 9: status 000 (and its neighbours) is malformed, not "no answer yet"
    seed("status-000", b"HTTP/1.1 000 Zero\r\nContent-Length: 2\r\n\r\n{}"),
    seed("status-000-bare", b"HTTP/1.1 000\r\n\r\n"),
    seed("status-099", b"HTTP/1.1 099 X\r\nContent-Length: 2\r\n\r\n{}"),
    # row 10: 600-999 is malformed, not relayed
    seed("status-600", b"HTTP/1.1 600 X\r\nContent-Length: 2\r\n\r\n{}"),
    seed("status-999", b"HTTP/1.1 999 X\r\nContent-Length: 2\r\n\r\n{}"),
    # row 11: buffered bodies capped, chunk sizes bounded, content codings decoded or
    # refused, 204/304 to a POST malformed
    seed("body-past-cap", length(b"x" * (BODY_CAP + 1))),
    seed("length-past-cap", b"HTTP/1.1 200 OK\r\nContent-Length: 524288000\r\n\r\nxx"),
    seed("close-body-past-cap", b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * (BODY_CAP + 1)),
    seed("chunk-2^64-1", CHUNKED + b"ffffffffffffffff\r\n" + b"x" * 4096),
    seed("chunk-2^64-1-closed", CHUNKED + b"ffffffffffffffff\r\n" + b"x" * 4096, close=True),
    seed("chunk-2^64-1-past-cap", CHUNKED + b"ffffffffffffffff\r\n" + b"x" * (BODY_CAP + 1)),
    seed("chunk-21-digits", CHUNKED + b"1" + b"0" * 20 + b"\r\nxx"),
    seed("gzip", length(gzip.compress(KV, mtime=0), b"Content-Encoding: gzip\r\n")),
    seed(
        "gzip-bomb", length(gzip.compress(bytes(8 * MIB), mtime=0), b"Content-Encoding: gzip\r\n")
    ),
    seed("gzip-cut", length(gzip.compress(KV, mtime=0)[:-4], b"Content-Encoding: gzip\r\n")),
    seed("gzip-empty", b"HTTP/1.1 204 No Content\r\nContent-Encoding: gzip\r\n\r\n", get=True),
    seed("brotli", length(b"\x1b\x01", b"Content-Encoding: br\r\n")),
    seed("204-to-post", b"HTTP/1.1 204 No Content\r\n\r\n"),
    seed("304-to-post", b"HTTP/1.1 304 Not Modified\r\nContent-Length: 2\r\n\r\n"),
    seed("204-to-get", b"HTTP/1.1 204 No Content\r\n\r\n", get=True),
    # trailers stay with their answer, never on the next one
    seed("trailers", CHUNKED + b"2\r\n{}\r\n0\r\nX-Trailer: t\r\nServer-Timing: a\r\n\r\n"),
    seed("trailer-length", CHUNKED + b"2\r\n{}\r\n0\r\nContent-Length: 9\r\n\r\n"),
    # framing: bytes after the answer, smuggling shapes, transfer codings
    seed("bytes-after-answer", OK + b"HTT"),
    seed("answer-after-answer", OK + KV_ANSWER),
    seed("conflicting-lengths", ok_with(b"Content-Length: 3\r\n") + b"x"),
    seed("plus-length", b"HTTP/1.1 200 OK\r\nContent-Length: +2\r\n\r\n{}"),
    seed("gzip-then-chunked", CHUNKED.replace(b"chunked", b"gzip, chunked") + b"0\r\n\r\n"),
    seed("chunked-twice", answer(b"Transfer-Encoding: chunked\r\n" * 2, b"0\r\n\r\n")),
    seed("chunked-then-gzip", CHUNKED.replace(b"chunked", b"chunked, gzip") + b"{}", close=True),
]


def cut(data: bytes, size: int) -> tuple[bytes, ...]:
    return tuple(data[i : i + size] for i in range(0, len(data), size))


READ = 256 * 1024  # what one socket read brings at most (asyncio's and uvloop's buffers)


def seed_exchanges() -> list[object]:
    """Each seed whole (in reads of ``READ`` bytes when longer) and in pieces (a byte at a
    time when short, 64 KiB when long)."""
    cases: list[object] = []
    for name, data, close, method in SEEDS:
        small = len(data) < 4096
        for how, parts in (
            ("whole", cut(data, READ)),
            ("pieces", cut(data, 1 if small else 65536)),
        ):
            exchange = Exchange(parts, (1,) * len(parts), close, method)
            cases.append(pytest.param(exchange, id=f"{name}-{how}"))
    return cases


@pytest.mark.parametrize("exchange", seed_exchanges())
def test_hostile_seed_gets_the_reference_verdict(exchange: Exchange) -> None:
    check(exchange)


@settings(
    max_examples=FUZZ_EXAMPLES or DEFAULT_EXAMPLES,
    derandomize=not FUZZ_EXAMPLES,
    deadline=None,
    database=None,
    print_blob=bool(FUZZ_EXAMPLES),  # a fuzz run's failure comes with its @reproduce_failure
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(exchange=exchanges())
def test_generated_answer_gets_the_reference_verdict(exchange: Exchange) -> None:
    check(exchange)


def test_each_known_divergence_still_reproduces() -> None:
    """A divergence fixed leaves the list (this fails until it does); an empty list is the
    goal."""
    for divergence in KNOWN_DIVERGENCES:
        with pytest.raises(pytest.fail.Exception):
            check(divergence.reproducer, excuse_known=False)
