"""An engine's own error event in the middle of a migratable stream cuts it like a reset:
not forwarded, the continuation asked for; past the limit the engine's event, once."""

import orjson
import pytest

from pdproxy.errors import EngineErrorEvent
from pdproxy.proxying.resumable import Continuation, ResumableStream
from pdproxy.wire.continuation import engine_error_at
from tests.unit.test_relay import FakeUpstream, PushingUpstream, _drain, _relay, _token

# vLLM's bytes (json.dumps' separators); the sim's own error events use orjson's
ERROR = (
    b'data: {"error": {"message": "Internal server error", "type": "InternalServerError",'
    b' "param": null, "code": 500}}\n\n'
)
DONE = b"data: [DONE]\n\n"
USAGE = b'data: {"choices":[],"usage":{"prompt_tokens":3}}\n\n'


@pytest.mark.parametrize(
    ("chunk", "at"),
    [
        (ERROR, 0),
        (ERROR + DONE, 0),
        (b'data: {"error":{"message":"x"}}\n\n', 0),  # orjson's separators
        (_token(1) + ERROR, len(_token(1))),  # read with the token before it
        (_token(1) + ERROR + DONE, len(_token(1))),
        (_token(1), -1),
        (USAGE, -1),  # ends like one, searched, none
        (USAGE + DONE, -1),
        (b'data: {"choices":[{"text":"data: {\\"error\\"}}"}]}\n\n', -1),  # escaped in text
    ],
)
def test_engine_error_at_finds_the_event_only_where_vllm_puts_it(chunk, at):
    assert engine_error_at(chunk) == at


class Resumes:
    """A ``Resume`` that records what it was handed and continues with ``then`` (or not)."""

    def __init__(self, then=None):
        self.calls, self.then = [], then

    async def __call__(self, stream, failure):
        self.calls.append((stream, failure))
        if self.then is None:
            return None
        return Continuation(_relay(FakeUpstream(self.then)), lambda chunk: chunk)


def _armed(chunks, resume):
    return ResumableStream(_relay(FakeUpstream(chunks)), resume, lambda _: True)


async def test_an_error_event_is_not_forwarded_and_the_stream_continues():
    resume = Resumes(then=[_token(2), DONE])
    out = await _drain(_armed([_token(0), _token(1), ERROR, DONE], resume))
    assert out == [_token(0), _token(1), _token(2), DONE]
    [(stream, failure)] = resume.calls
    assert stream == _token(0) + _token(1) and isinstance(failure, EngineErrorEvent)


async def test_events_read_with_the_error_event_go_out_first():
    resume = Resumes(then=[_token(2), DONE])
    out = await _drain(_armed([_token(0), _token(1) + ERROR + DONE], resume))
    assert out == [_token(0), _token(1), _token(2), DONE]
    assert resume.calls[0][0] == _token(0) + _token(1)


@pytest.mark.parametrize("coalesced", [False, True])
async def test_when_it_cannot_continue_the_client_gets_the_engine_s_event_once(coalesced):
    chunks = [_token(0), _token(1) + ERROR + DONE] if coalesced else [_token(0), ERROR, DONE]
    relay = _armed(chunks, Resumes())
    raw = b"".join(await _drain(relay))
    assert raw.count(b'"error"') == 1 and raw.endswith(ERROR + DONE)
    assert isinstance(relay.failure, EngineErrorEvent)


async def test_a_stream_that_may_not_migrate_passes_the_event_as_today():
    chunks = [_token(0), ERROR, DONE]
    relay = _relay(FakeUpstream(chunks))
    assert await _drain(relay) == chunks
    assert relay.failure is None


async def test_a_directly_relayed_error_event_is_left_to_next_chunk_which_cuts():
    upstream, written = PushingUpstream([_token(0)]), []
    plain = _relay(upstream)
    resume = Resumes(then=[_token(2), DONE])
    relay = ResumableStream(plain, resume, lambda _: True)
    await plain.prime()
    assert await relay.next_chunk() == _token(0)
    relay.relay_directly(lambda c: written.append(c) or True)
    upstream.arrive(_token(1))
    upstream.arrive(ERROR)
    upstream.arrive(DONE)
    assert written == [_token(1)]
    assert await _drain(relay) == [_token(2), DONE]
    assert orjson.loads(resume.calls[0][1].event[6:])["error"]["code"] == 500


async def test_an_error_event_in_the_primed_first_read_is_cut_and_kept_once():
    plain = _relay(FakeUpstream([_token(0) + _token(1) + ERROR + DONE]))
    await plain.prime()  # the whole answer in the first read, as from a fast engine
    resume = Resumes(then=[_token(2), DONE])
    relay = ResumableStream(plain, resume, lambda _: True)
    assert await _drain(relay) == [_token(0) + _token(1), _token(2), DONE]
    assert resume.calls[0][0] == _token(0) + _token(1)
