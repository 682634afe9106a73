"""StreamRelay against an in-memory upstream: pass-through, end detection, terminal errors."""

import orjson
import pytest

from pdproxy.errors import UpstreamProtocolError, UpstreamTimeout
from pdproxy.relay import StreamRelay, StreamWatchdog


class FakeUpstream:
    def __init__(self, chunks, error=None):
        self._chunks = list(chunks)
        self._error = error
        self.released = self.closed = False

    async def read_chunk(self):
        if self._chunks:
            return self._chunks.pop(0)
        if self._error is not None:
            raise self._error
        return b""

    def release(self):
        self.released = True

    def close(self):  # like aiohttp: a closed response reads as the end of the body
        self.closed = True
        self._chunks.clear()
        self._error = None


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _relay(upstream, on_close=lambda: None, watchdog=None):
    return StreamRelay(upstream, on_close, watchdog or StreamWatchdog(600.0))


async def _drain(relay):
    out = []
    while (chunk := await relay.next_chunk()) is not None:
        out.append(chunk)
    return out


@pytest.mark.parametrize(
    "chunks",
    [
        [b'data: {"a": 1}\n\n', b"data: [DONE]\n\n"],
        [b'data: {"a": 1}\n\ndata: [DO', b"NE]\n\n"],  # the marker split across chunks
        [b'data: {"a": 1}\n\ndata: [DONE]', b"\n", b"\n"],
    ],
)
async def test_complete_stream_passes_through_and_pools_the_connection(chunks):
    upstream, closes = FakeUpstream(chunks), []
    relay = _relay(upstream, lambda: closes.append(1))
    assert await _drain(relay) == chunks  # bytes untouched, chunk for chunk
    assert upstream.released
    relay.close()
    relay.close()
    assert closes == [1]  # counters freed exactly once


@pytest.mark.parametrize(
    ("chunks", "error", "etype"),
    [
        ([b'data: {"a": 1}\n\n'], None, "BadGatewayError"),  # ended without [DONE]
        ([b'data: {"a": 1}\n\ndata: {"b"'], None, "BadGatewayError"),  # cut mid-event
        ([b'data: {"a": 1}\n\n'], UpstreamTimeout("silent", leg="decode"), "GatewayTimeoutError"),
        ([], UpstreamProtocolError("reset", leg="decode"), "BadGatewayError"),
    ],
)
async def test_broken_stream_ends_with_one_error_event(chunks, error, etype):
    upstream = FakeUpstream(chunks, error)
    out = await _drain(_relay(upstream))
    assert out[:-1] == chunks
    last = out[-1]
    assert not upstream.released
    events = [e for e in (b"".join(out)).split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and events[-2].startswith(b"data: {")
    assert orjson.loads(events[-2][6:])["error"]["type"] == etype
    assert last.count(b'"error"') == 1


async def test_abort_reports_its_own_reason():
    from pdproxy.errors import UpstreamStatusError

    upstream = FakeUpstream([b'data: {"a": 1}\n\n'])
    relay = _relay(upstream)
    assert await relay.next_chunk() == b'data: {"a": 1}\n\n'
    reason = UpstreamStatusError(
        leg="prefill", status=500, body=b"", content_type="application/json"
    )
    relay.abort(reason)
    assert upstream.closed
    last = await relay.next_chunk()
    assert b"prefill engine answered HTTP 500" in last
    assert await relay.next_chunk() is None


async def test_watchdog_aborts_only_silent_streams():
    clock = Clock()
    watchdog = StreamWatchdog(10.0, clock)
    quiet, busy = FakeUpstream([b"data: {}\n\n"]), FakeUpstream([b"data: {}\n\n", b"data: {}\n\n"])
    quiet_relay, busy_relay = _relay(quiet, watchdog=watchdog), _relay(busy, watchdog=watchdog)
    clock.now += 6
    await busy_relay.next_chunk()  # activity stamps the busy stream
    clock.now += 6
    watchdog.sweep()
    assert quiet.closed and not busy.closed
    last = await quiet_relay.next_chunk()
    assert b"GatewayTimeoutError" in last and b"silent for 10 s" in last
    busy_relay.close()
    clock.now += 100
    watchdog.sweep()  # a closed stream is no longer watched
    assert not busy.released
