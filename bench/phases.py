"""pdproxy's time to first byte by phase: its access lines joined with a client's stamps.

pdproxy's access line (text or JSON, as ``--log-format`` says) carries its own
``time.perf_counter()`` intervals for each request, in milliseconds from the request's
arrival at its handler: ``prefill_sent_ms``, ``prefill_ms`` (the leg), ``decode_sent_ms``,
``decode_headers_ms`` and ``ttfb_ms`` (the first body byte written). The client names each
request with ``X-Request-Id`` and stamps its own TTFT; joined on the id, every millisecond of
the client's TTFT is assigned to one phase:

- arrival → prefill sent: the body's parse, the policy's pick, the prefill body;
- prefill leg: from sending it to its whole answer;
- prefill answer → decode sent: the decode body's making, the decode's connection;
- decode headers: from sending the decode leg to its response headers;
- decode headers → first byte written: the stream's first bytes awaited, the response's start;
- client → handler + first byte → client: the client's TTFT minus pdproxy's ttfb (the
  connection, uvicorn's parse, the wait for pdproxy's loop, the write and the client's read).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

ACCESS_LOGGER = "pdproxy.access"
_FIELDS = ("prefill_sent_ms", "prefill_ms", "decode_sent_ms", "decode_headers_ms", "ttfb_ms")

# key, title: in the order a request goes through them
PHASES: tuple[tuple[str, str], ...] = (
    ("to_prefill", "arrival → prefill sent"),
    ("prefill", "prefill leg (sent → answered)"),
    ("to_decode", "prefill answered → decode sent"),
    ("decode_headers", "decode leg (sent → headers)"),
    ("to_first_byte", "decode headers → first byte written"),
    ("ttfb", "pdproxy: arrival → first byte written"),
    ("outside", "client → handler + first byte → client"),
    ("client_ttft", "client TTFT"),
)


def access_lines(lines: Iterable[str]) -> dict[str, dict[str, Any]]:
    """pdproxy's access lines by request id, from a log in either format."""
    out: dict[str, dict[str, Any]] = {}
    for raw in lines:
        record = _json_line(raw) if raw.startswith("{") else _text_line(raw)
        if record is not None and record.get("request_id"):
            out[str(record["request_id"])] = record
    return out


def _json_line(raw: str) -> dict[str, Any] | None:
    with contextlib.suppress(ValueError):
        record = json.loads(raw)
        if isinstance(record, dict) and record.get("logger") == ACCESS_LOGGER:
            return record
    return None


def _text_line(raw: str) -> dict[str, Any] | None:
    """``ts LEVEL pdproxy.access: message k=v ... request_id=ID``: the ids and the times."""
    _, marker, tail = raw.partition(f" {ACCESS_LOGGER}: ")
    if not marker:
        return None
    record: dict[str, Any] = {}
    for token in tail.split():
        key, eq, value = token.partition("=")
        if not eq:
            continue
        if key == "request_id":
            record[key] = value
        elif key in _FIELDS:
            record[key] = None if value == "-" else float(value)
    return record


def samples(
    stamps: Mapping[str, float], lines: Mapping[str, Mapping[str, Any]]
) -> dict[str, list[float]]:
    """Each phase's milliseconds over the requests both sides saw (``stamps``: the client's
    TTFT in seconds by request id) whose access line has every interval (a request served
    by a prefill and a decode)."""
    out: dict[str, list[float]] = {key: [] for key, _ in PHASES}
    for rid, ttft in stamps.items():
        line = lines.get(rid)
        if line is None or any(line.get(f) is None for f in _FIELDS):
            continue
        to_prefill, prefill, to_decode_sent, headers, ttfb = (float(line[f]) for f in _FIELDS)
        values = {
            "to_prefill": to_prefill,
            "prefill": prefill,
            "to_decode": to_decode_sent - to_prefill - prefill,
            "decode_headers": headers,
            "to_first_byte": ttfb - to_decode_sent - headers,
            "ttfb": ttfb,
            "outside": 1000 * ttft - ttfb,
            "client_ttft": 1000 * ttft,
        }
        for key, value in values.items():
            out[key].append(value)
    return out


def quantile(values: Sequence[float], q: float) -> float:
    """The same rank as the bench's TTFT percentiles (``bench.load.Result.ttft_ms``)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def figures(phases: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """``phase_<key>_p50``/``_p99`` (ms) and ``phase_requests`` (the requests joined)."""
    n = len(phases.get("ttfb", ()))
    out: dict[str, float] = {"phase_requests": n}
    if n:
        for key, _ in PHASES:
            out[f"phase_{key}_p50"] = quantile(phases[key], 0.5)
            out[f"phase_{key}_p99"] = quantile(phases[key], 0.99)
    return out
