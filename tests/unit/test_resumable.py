"""The wrappers around a plain relay compose, and a cut leaves nothing for the garbage
collector: each stream's objects go when their last reference does."""

import gc
import weakref

import orjson

from pdproxy.errors import UpstreamProtocolError, UpstreamTimeout
from pdproxy.proxying.resumable import Continuation, ResumableStream, TranslatedStream
from pdproxy.proxying.watchdog import StreamWatchdog
from tests.unit.test_relay import FakeUpstream, PushingUpstream, _drain, _relay, _token

DONE = b"data: [DONE]\n\n"
RESET = UpstreamProtocolError("reset", leg="decode")


def _continuing(then, calls):
    async def resume(delivered, failure):
        calls.append((delivered, failure))
        return Continuation(_relay(FakeUpstream(then)), lambda chunk: chunk.replace(b"t", b"T"))

    return resume


async def test_a_translated_resumable_stream_translates_the_continuation_too():
    calls = []
    cut = _relay(FakeUpstream([_token(0)], RESET))
    stream = TranslatedStream(
        ResumableStream(cut, _continuing([_token(1), DONE], calls), lambda _: True),
        lambda chunk: chunk.upper(),
    )
    out = await _drain(stream)
    assert out == [_token(0).upper(), _token(1).replace(b"t", b"T").upper(), DONE.upper()]
    assert calls == [(_token(0), RESET)] and cut.failure is RESET
    assert stream.failure is None  # the continuation's: complete


async def test_the_cut_leg_ends_before_the_continuation_is_read():
    closed, calls = [], []
    cut = _relay(FakeUpstream([_token(0)], RESET), on_close=lambda: closed.append(len(calls)))
    stream = ResumableStream(cut, _continuing([DONE], calls), lambda _: True)
    assert await _drain(stream) == [_token(0), DONE.replace(b"t", b"T")]
    assert closed == [0]  # closed once, before resume was asked


async def test_past_the_stream_cap_it_is_never_continued():
    calls = []
    watchdog = StreamWatchdog(600.0)
    watchdog.max_stream = 2 * len(_token(0))
    upstream = PushingUpstream([_token(0), _token(1), _token(2), DONE])
    stream = ResumableStream(
        _relay(upstream, watchdog=watchdog), _continuing([DONE], calls), lambda _: True
    )
    raw = b"".join(await _drain(stream))
    assert calls == [] and b"over" in raw and raw.endswith(DONE)
    assert isinstance(stream.failure, UpstreamProtocolError)


async def test_a_continuation_that_fails_ends_with_its_own_event_once():
    async def resume(delivered, failure):
        return Continuation(
            _relay(FakeUpstream([_token(1)], UpstreamTimeout("slow", leg="decode"))), bytes
        )

    stream = ResumableStream(_relay(FakeUpstream([_token(0)], RESET)), resume, lambda _: True)
    out = await _drain(stream)
    assert out[:2] == [_token(0), _token(1)] and len(out) == 3
    assert orjson.loads(out[2].split(b"\n\n")[0][6:])["error"]["message"] == "slow"
    assert isinstance(stream.failure, UpstreamTimeout)


async def test_a_cut_stream_is_freed_by_its_last_reference_not_the_collector():
    """A failure raised through the wrappers kept their frames (the relay, the kept bytes) in
    a cycle: 133 MiB held under an endless-event attack until a collection."""
    gc.disable()
    try:
        for upstream in (FakeUpstream([_token(0)], RESET), PushingUpstream([_token(0)])):
            relay = _relay(upstream)
            stream = ResumableStream(relay, _continuing_none, lambda _: True)
            if isinstance(upstream, PushingUpstream):
                await relay.prime()
                assert await stream.next_chunk() == _token(0)
                stream.relay_directly(lambda c: True)
                upstream.arrive(b"x" * 100)  # an unended event
                relay.abort(RESET)
            raw = b"".join(await _drain(stream))
            assert b'"error"' in raw
            stream.close()
            gone = weakref.ref(relay), weakref.ref(stream)
            del relay, stream, upstream
            assert [ref() for ref in gone] == [None, None]
    finally:
        gc.enable()


async def _continuing_none(delivered, failure):
    return None
