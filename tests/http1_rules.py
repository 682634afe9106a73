"""The rules of tests/unit/test_http1_differential.py: each known, intended difference
between pdproxy's legs' client and h11 (the reference), named, with its reason, and what it
lets pdproxy's verdict be (``accepted``). A rule reads the answer's bytes leniently
(tests/http1_answers.py's ``heads``, ``chunk_lines``): only to see whether it applies,
never to judge the answer."""

from __future__ import annotations

import dataclasses
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pdproxy.upstream.http1.connection import MAX_FIELDS, MAX_HEAD, MAX_LINE
from tests.http1_answers import chunk_lines, chunked_start, final_head, heads
from tests.http1_reference import NEXT, Exchange, Verdict

ERROR = Verdict("error")
BODY_CAP = 350_000  # the pool's max_body in the test: generated bodies reach 400,000 bytes

_TOKEN = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+"
_CHUNK_EXT = re.compile(
    rb'(?:[ \t]*;[ \t]*%s(?:[ \t]*=[ \t]*(?:%s|"(?:[^"\\]|\\.)*"))?)*' % (_TOKEN, _TOKEN)
)


# --- the rules: where pdproxy means to differ from h11, and why ---

Effect = Literal["decode", "refuse", "may-refuse", "may-reuse", "may-not-reuse"]


@dataclass(frozen=True)
class Rule:
    """``decode``: pdproxy's body is h11's decoded; ``refuse``: pdproxy must answer an
    error where h11 reads a message or waits; ``may-refuse``: either is right (the RFC
    leaves it to the recipient); ``may-reuse``/``may-not-reuse``: reusing the connection
    or not is either right. ``applies`` sees h11's verdict as the rules before changed it."""

    name: str
    why: str
    effect: Effect
    applies: Callable[[Exchange, Verdict], bool]


def _version(exchange: Exchange, pattern: bytes, interim: bool = False) -> bool:
    """A head (an interim one only, if ``interim``) has a version matching ``pattern``."""
    found = heads(exchange.data)[0]
    if interim:
        found = tuple(h for h in found if h.interim)
    return any(re.fullmatch(pattern, h.version) for h in found)


def _status_over_599(exchange: Exchange, reference: Verdict) -> bool:
    head = final_head(exchange)
    code = head.code if head is not None and head.complete else None
    return (code or 0) >= 600 or (reference.kind == "message" and reference.status >= 600)


def _duplicate_length(exchange: Exchange, _: Verdict) -> bool:
    head = final_head(exchange)
    lengths = head.values(b"content-length") if head else []
    return len(lengths) > 1 and len(set(lengths)) == 1


def _length_and_chunked(exchange: Exchange, _: Verdict) -> bool:
    head = final_head(exchange)
    return bool(head and head.values(b"content-length") and head.values(b"transfer-encoding"))


def _folded(exchange: Exchange, _: Verdict) -> bool:
    return any(line[:1] in (b" ", b"\t") for h in heads(exchange.data)[0] for line in h.lines)


def _bare_lf(exchange: Exchange, _: Verdict) -> bool:
    return any(h.bare_lf for h in heads(exchange.data)[0])


def _framing_on_interim(exchange: Exchange, _: Verdict) -> bool:
    framing = (b"content-length", b"transfer-encoding")
    return any(h.interim and h.values(n) for h in heads(exchange.data)[0] for n in framing)


def _framing_in_trailers(exchange: Exchange, _: Verdict) -> bool:
    start = chunked_start(exchange)
    trailers = None if start is None else chunk_lines(exchange.data, start).trailers
    if trailers is None:
        return False
    lines = exchange.data[trailers:].split(b"\n\r\n", 1)[0].split(b"\n")
    return any(line.lower().startswith(b"content-length:") for line in lines)


def _keep_alive_10(exchange: Exchange, reference: Verdict) -> bool:
    head = final_head(exchange)
    return bool(
        reference.kind == "message"
        and head
        and head.version in (b"HTTP/1.0", b"HTTP/0.9")
        and b"keep-alive" in [v.lower() for v in head.values(b"connection")]
    )


_WBITS = {b"gzip": 31, b"x-gzip": 31, b"deflate": 15}  # zlib's, for each coding's wrapper


def _coding(exchange: Exchange) -> bytes:
    head = final_head(exchange)
    return b", ".join(head.values(b"content-encoding")).lower() if head else b""


def _unknown_coding(exchange: Exchange, _: Verdict) -> bool:
    head = final_head(exchange)
    coding = _coding(exchange)
    return bool(head and head.complete and coding not in (b"", b"identity", *_WBITS))


def _decoded(exchange: Exchange, verdict: Verdict) -> Verdict:
    """The message with its body decoded as its Content-Encoding says, or an error (an
    empty body stays empty: a 204's coding codes no bytes)."""
    wbits = _WBITS.get(_coding(exchange))
    if wbits is None:
        return ERROR
    if not verdict.body:
        return verdict
    z = zlib.decompressobj(wbits)
    try:
        body = z.decompress(verdict.body)
    except zlib.error:
        return ERROR
    if not z.eof or z.unused_data:
        return ERROR
    return dataclasses.replace(verdict, body=body)


def _coded(exchange: Exchange, reference: Verdict) -> bool:
    return reference.kind == "message" and _coding(exchange) not in (b"", b"identity")


def _over_caps(exchange: Exchange, _: Verdict) -> bool:
    return any(
        h.size > MAX_HEAD or len(h.lines) - 1 > MAX_FIELDS or max(map(len, h.lines)) > MAX_LINE
        for h in heads(exchange.data)[0]
    )


def _received(exchange: Exchange) -> bytes | None:
    """The body bytes of the final answer that arrived (None before its head is whole)."""
    found, start = heads(exchange.data)
    if not found or not found[-1].complete:
        return None
    head, data = found[-1], exchange.data
    if head.values(b"transfer-encoding"):
        return chunk_lines(data, start).received
    lengths = head.values(b"content-length")
    if len(set(lengths)) == 1 and lengths[0].isdigit():
        return data[start : start + int(lengths[0])]
    return data[start:]


def _decoded_so_far(exchange: Exchange) -> bytes | None:
    """What the received body decodes to so far; None if it cannot be a coded stream's
    start (or nothing is coded)."""
    body, wbits = _received(exchange), _WBITS.get(_coding(exchange))
    if body is None or wbits is None:
        return None
    try:
        return zlib.decompressobj(wbits).decompress(body)
    except zlib.error:
        return None


def _coding_fails_early(exchange: Exchange, reference: Verdict) -> bool:
    return (
        reference.kind != "message"
        and _coding(exchange) in _WBITS
        and bool(_received(exchange))
        and _decoded_so_far(exchange) is None
    )


def _body_over_cap(exchange: Exchange, reference: Verdict) -> bool:
    """The body h11 read is over the cap, or (h11 still waiting) its Content-Length says it
    will be, or the bytes that came (decoded, for a coded body) already are."""
    if reference.kind == "message":
        return len(reference.body) > BODY_CAP
    head = final_head(exchange)
    if head is None or not head.complete:
        return False
    lengths = head.values(b"content-length")
    start = chunked_start(exchange)
    if start is not None and any(n > BODY_CAP for n, _ in chunk_lines(exchange.data, start).lines):
        return True  # a chunk announced over the cap
    if _coding(exchange) not in (b"", b"identity"):
        body = _decoded_so_far(exchange)
    elif not head.values(b"transfer-encoding") and len(set(lengths)) == 1:
        return lengths[0].isdigit() and int(lengths[0]) > BODY_CAP
    else:
        body = _received(exchange)
    return body is not None and len(body) > BODY_CAP


def _bad_chunk_ext(exchange: Exchange, _: Verdict) -> bool:
    start = chunked_start(exchange)
    sizes = [] if start is None else chunk_lines(exchange.data, start).lines
    return any(not _CHUNK_EXT.fullmatch(ext) for _, ext in sizes)


def _control_char(exchange: Exchange, _: Verdict) -> bool:
    lines = (line for h in heads(exchange.data)[0] for line in h.lines)
    return any(re.search(rb"[\x00-\x08\x0a-\x1f\x7f]", line) for line in lines)


RULES: tuple[Rule, ...] = (
    Rule(
        "content-coding",
        "pdproxy decodes a gzip or deflate body as it reads it (its Content-Encoding kept), "
        "a body that does not decode is an error (issue 19 item 1: never relay coded bytes "
        "as JSON); h11 hands the coded bytes on",
        "decode",
        _coded,
    ),
    Rule(
        "content-coding-fails-early",
        "a coded body is decoded as its bytes come, so one whose first bytes cannot be a "
        "gzip or deflate stream fails there; h11 (no decoding) waits for the rest",
        "refuse",
        _coding_fails_early,
    ),
    Rule(
        "content-coding-unknown",
        "any other content coding (br, zstd, codings stacked) is refused at the head: pdproxy "
        "could not read the body (issue 19 item 1); h11 does not look",
        "refuse",
        _unknown_coding,
    ),
    Rule(
        "head-over-caps",
        f"pdproxy caps a head as aiohttp does ({MAX_LINE} bytes a line, {MAX_FIELDS} fields, "
        f"{MAX_HEAD} bytes in all; issue 19 row 3); h11 bounds only a head still incomplete",
        "refuse",
        _over_caps,
    ),
    Rule(
        "body-over-cap",
        f"a body read whole is refused past the pool's max_body ({BODY_CAP} here; issue 19 "
        "row 11), as soon as a Content-Length or a chunk's size line announces it (the "
        "chunk sizes are read ahead of httptools, which does not tell them), else as its "
        "bytes come; h11 has no cap",
        "refuse",
        _body_over_cap,
    ),
    Rule(
        "status-outside-100-599",
        "h11 reads 600-999 as a final answer; RFC 9110 §15 defines 100-599 and uvicorn drops "
        "the client on anything else (issue 19 row 10): pdproxy refuses it at the head",
        "refuse",
        _status_over_599,
    ),
    Rule(
        "no-content-to-post",
        "a 204 or 304 cannot answer vLLM's POSTs; relayed, the client gets an empty answer "
        "(issue 19 item 1): pdproxy treats it as malformed, h11 as a message without body",
        "refuse",
        lambda ex, ref: ex.method == "POST" and ref.kind == "message" and ref.status in (204, 304),
    ),
    Rule(
        "duplicate-content-length",
        "RFC 9110 §8.6 lets a recipient either reject repeated identical Content-Length "
        "values or use the one value; h11 uses it, llhttp (pdproxy's parser) rejects",
        "may-refuse",
        _duplicate_length,
    ),
    Rule(
        "content-length-with-transfer-encoding",
        "RFC 9112 §6.3 (3): Transfer-Encoding overrides Content-Length, and the message "
        "'ought to be handled as an error' (smuggling); h11 reads it chunked, llhttp rejects",
        "may-refuse",
        _length_and_chunked,
    ),
    Rule(
        "framing-on-interim",
        "RFC 9112 §6.3 (1): a 1xx ends at its empty line whatever its fields say, and RFC 9110 "
        "§8.6 forbids it a Content-Length; h11 ignores the field, pdproxy refuses the answer "
        "(a broken engine, or an attempt to desynchronise the connection)",
        "may-refuse",
        _framing_on_interim,
    ),
    Rule(
        "framing-field-in-trailers",
        "RFC 9110 §6.5.1: framing fields may not be trailers; h11 ignores a Content-Length "
        "trailer, llhttp refuses the answer",
        "may-refuse",
        _framing_in_trailers,
    ),
    Rule(
        "control-character-in-head",
        "RFC 9110 §5.5: a field value with a control character is invalid, a recipient may "
        "keep it or reject the message; h11 keeps any but NUL, CR and LF, llhttp rejects",
        "may-refuse",
        _control_char,
    ),
    Rule(
        "malformed-chunk-extension",
        "RFC 9112 §7.1.1 gives chunk extensions a grammar (';' name ['=' value]); h11 skips "
        "whatever follows the size unchecked, llhttp rejects what breaks the grammar",
        "may-refuse",
        _bad_chunk_ext,
    ),
    Rule(
        "obs-fold",
        "RFC 9112 §5.2: a gateway that receives obs-fold in a response either answers 502 or "
        "unfolds it; h11 unfolds, llhttp rejects (pdproxy then answers 502)",
        "may-refuse",
        _folded,
    ),
    Rule(
        "bare-lf",
        "RFC 9112 §2.2: a recipient MAY take a lone LF as a line end; h11 does, llhttp rejects",
        "may-refuse",
        _bare_lf,
    ),
    Rule(
        "minor-version-above-1.1",
        "RFC 9112 §2.3: HTTP/1.2 SHOULD be read as HTTP/1.1; llhttp knows only the versions "
        "that exist and refuses (the safe side for a proxy's upstream)",
        "may-refuse",
        lambda ex, _: _version(ex, rb"HTTP/1\.[2-9]"),
    ),
    Rule(
        "interim-answer-in-http-1.0",
        "HTTP/1.0 has no 1xx (RFC 9110 §15.2: never sent to an HTTP/1.0 client, and this "
        "client is HTTP/1.1): llhttp takes an HTTP/1.0 1xx as ending the connection and "
        "refuses what follows; h11 skips it",
        "may-refuse",
        lambda ex, _: _version(ex, rb"HTTP/(1\.0|0\.9)", interim=True),
    ),
    Rule(
        "major-version-not-1",
        "an HTTP/0.9 or HTTP/2+ status line is not an HTTP/1.1 answer: h11 reads 2.0 as above "
        "1.1 (reusable); refusing it, or reading it without reusing the connection, is safe",
        "may-refuse",
        lambda ex, _: _version(ex, rb"HTTP/(0\.9|[2-9]\.[0-9])"),
    ),
    Rule(
        "major-version-not-1-reuse",
        "(with major-version-not-1) llhttp reads HTTP/2.0 but does not keep the connection",
        "may-not-reuse",
        lambda ex, _: _version(ex, rb"HTTP/[2-9]\.[0-9]"),
    ),
    Rule(
        "empty-line-after-answer",
        "llhttp skips empty lines between answers (as RFC 9112 §2.2 lets a server skip them "
        "before a request), so the connection stays clean; h11 keeps them as unread bytes "
        "and does not reuse it: either is safe, the next answer reads whole",
        "may-reuse",
        lambda _, ref: ref.kind == "message" and ref.leftover.strip(b"\r\n") == b"" != ref.leftover,
    ),
    Rule(
        "http-1.0-keep-alive",
        "RFC 9112 §9.3 / appendix C.2.2: a client may honour an HTTP/1.0 answer's keep-alive "
        "option; h11 never reuses an HTTP/1.0 (or 0.9) connection, llhttp does",
        "may-reuse",
        _keep_alive_10,
    ),
)


def accepted(exchange: Exchange, reference: Verdict) -> tuple[list[Verdict], list[str]]:
    """The verdicts pdproxy may reach, given h11's, and the names of the rules applied."""
    allowed, applied = [reference], []
    for rule in RULES:
        if not rule.applies(exchange, allowed[0]):
            continue
        applied.append(rule.name)
        if rule.effect == "refuse":
            return [ERROR], applied
        if rule.effect == "decode":
            allowed = [_decoded(exchange, v) for v in allowed]
        elif rule.effect == "may-refuse":
            allowed.append(ERROR)
        elif rule.effect == "may-reuse":
            allowed += [dataclasses.replace(v, reusable=True, next=NEXT) for v in allowed]
        else:
            allowed += [dataclasses.replace(v, reusable=False, next=None) for v in allowed]
    return allowed, applied
