"""StreamRelay against an in-memory upstream: pass-through, end detection, terminal errors."""

import orjson
import pytest

from pdproxy.errors import UpstreamProtocolError, UpstreamTimeout
from pdproxy.proxying.relay import StreamRelay
from pdproxy.proxying.resumable import TranslatedStream
from pdproxy.proxying.watchdog import StreamWatchdog


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


# -- relay_directly: chunks handed to a writer from the upstream's callback -------------------


class PushingUpstream(FakeUpstream):
    """Chunks ``arrive`` as from the engine connection's callback: offered to the sink
    ``push_to`` set, buffered for ``read_chunk`` when there is none or it declines."""

    def __init__(self, chunks=()):
        super().__init__(chunks)
        self.sink = None

    def push_to(self, sink):
        self.sink = sink

    def close(self):  # like UpstreamResponse: a closed answer holds no sink
        super().close()
        self.sink = None

    def arrive(self, chunk):
        if self.sink is None or self._chunks or not self.sink(chunk):
            self._chunks.append(chunk)


def _token(i: int) -> bytes:
    return b'data: {"choices":[{"text":"t%d"}]}\n\n' % i


async def _primed(upstream, **kw):
    relay = _relay(upstream, **kw)
    await relay.prime()
    assert await relay.next_chunk() == _token(0)
    return relay


async def test_direct_chunks_skip_next_chunk_and_the_end_still_comes_through_it():
    upstream, written = PushingUpstream([_token(0)]), []
    relay = await _primed(upstream)
    relay.relay_directly(lambda c: written.append(c) or True)
    for i in range(1, 4):
        upstream.arrive(_token(i))
    upstream.arrive(b"data: [DONE]\n\n")  # the last chunk: declined, the caller ends with it
    assert written == [_token(1), _token(2), _token(3)]
    assert relay.pushed == sum(map(len, written))
    assert await _drain(relay) == [b"data: [DONE]\n\n"]
    assert upstream.released and relay.failure is None


async def test_a_declined_chunk_and_those_after_it_come_through_next_chunk_in_order():
    upstream, written = PushingUpstream([_token(0)]), []
    relay = await _primed(upstream)
    full = {"now": False}
    relay.relay_directly(lambda c: not full["now"] and (written.append(c) or True))
    upstream.arrive(_token(1))
    full["now"] = True
    upstream.arrive(_token(2))  # declined: direct relaying stops
    full["now"] = False
    upstream.arrive(_token(3))  # buffered behind it, not written
    assert written == [_token(1)] and upstream.sink is None
    assert await relay.next_chunk() == _token(2)
    assert await relay.next_chunk() == _token(3)
    relay.relay_directly(lambda c: written.append(c) or True)  # re-armed by the caller
    upstream.arrive(_token(4))
    assert written == [_token(1), _token(4)]


async def test_a_stream_cut_after_direct_chunks_ends_with_one_error_event():
    upstream, written = PushingUpstream([_token(0)]), []
    relay = await _primed(upstream)
    relay.relay_directly(lambda c: written.append(c) or True)
    upstream.arrive(_token(1))
    upstream.arrive(b'data: {"choices":[{"te')  # cut mid-event; then the body ends
    out = await _drain(relay)
    assert len(out) == 1 and out[0].startswith(b"\n\ndata: ")  # the cut event is closed off
    assert orjson.loads(out[0].split(b"data: ")[1])["error"]["type"] == "BadGatewayError"
    assert relay.failure is not None and not upstream.released


async def test_direct_chunks_keep_the_watchdog_away():
    clock = Clock()
    watchdog = StreamWatchdog(10.0, clock=clock)
    upstream = PushingUpstream([_token(0)])
    relay = await _primed(upstream, watchdog=watchdog)
    relay.relay_directly(lambda c: True)
    for i in range(1, 6):
        clock.now += 5
        upstream.arrive(_token(i))
        watchdog.sweep()
    assert relay.failure is None and not upstream.closed


async def test_a_translated_stream_is_never_relayed_directly():
    upstream = PushingUpstream([_token(0)])
    relay = _relay(upstream)
    await relay.prime()
    stream = TranslatedStream(relay, lambda c: c.upper())
    assert await stream.next_chunk() == _token(0).upper()
    stream.relay_directly(lambda c: True)
    assert upstream.sink is None


async def test_a_translated_stream_s_error_event_passes_untranslated():
    relay = _relay(FakeUpstream([b'data: {"a": 1}\n\n'], UpstreamTimeout("slow", leg="decode")))
    stream = TranslatedStream(relay, lambda c: c.upper())
    first, event = await _drain(stream)
    assert first == b'DATA: {"A": 1}\n\n'
    assert event.endswith(b"data: [DONE]\n\n") and b"DATA" not in event
    assert orjson.loads(event.split(b"\n\n")[0][6:])["error"]["message"] == "slow"
    assert await stream.next_chunk() is None and stream.failure is relay.failure


async def test_closing_stops_direct_relaying():
    upstream, written = PushingUpstream([_token(0)]), []
    relay = await _primed(upstream)
    relay.relay_directly(lambda c: written.append(c) or True)
    relay.close()
    upstream.arrive(_token(1))
    assert written == []
