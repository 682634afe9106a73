"""The fault matrix on the direct relay: streamed chunks written into the client's connection
from the engine connection's callback (pdproxy/api/direct.py). Each case first checks that
the stream did go that way (a spy on the writer), then what the client got: every token in
order, one terminal error event where the engine failed, no hung request, counters back to
0."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass, field

import orjson
import pytest

import pdproxy.api.openai as openai_api
from pdproxy.api.direct import direct_writer
from tests.faults.harness import NO_MIGRATION, assert_settled, body, drive, fleet, wait_until

pytestmark = pytest.mark.faults


@dataclass
class Spy:
    writers: int = 0  # streams that got a direct writer
    written: int = 0  # chunks it took
    declined: int = 0  # chunks it handed back to send
    seen: list[bytes] = field(default_factory=list)
    send_buffer: int | None = None  # shrink the client connection's kernel send buffer to it

    @property
    def events(self) -> int:
        """Token events written directly. Events, not writes, are counted: on a busy machine
        one read brings several tokens, and the relay writes a read's pieces at once."""
        return sum(chunk.count(b"data: {") for chunk in self.seen)


@pytest.fixture
def spy(monkeypatch) -> Spy:
    spy = Spy()

    def spying(send):
        write = direct_writer(send)
        if write is None:
            return None
        spy.writers += 1
        if spy.send_buffer is not None:  # a full socket after a few KiB, not a few MiB
            sock = send.__self__.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, spy.send_buffer)

        def counted(chunk: bytes) -> bool:
            taken = write(chunk)
            if taken:
                spy.written += 1
                spy.seen.append(chunk)
            else:
                spy.declined += 1
            return taken

        return counted

    monkeypatch.setattr(openai_api, "direct_writer", spying)
    return spy


def _events(raw: bytes) -> list[bytes]:
    return [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]


async def test_a_whole_stream_goes_direct_and_arrives_in_order(spy):
    async with fleet(decode_tps=400) as f:
        outcomes = await drive(f, 4, stream=True, chat=False, max_tokens=24)
        assert all(o.status == 200 and o.error is None for o in outcomes)
        assert spy.writers == 4 and spy.events >= 4 * 20 and spy.declined == 0
        for o in outcomes:
            texts = [orjson.loads(e)["choices"][0]["text"] for e in _events(o.body)[:-1]]
            assert len(texts) == 24  # one event per token, none lost, none doubled
        await assert_settled(f)


async def test_decode_killed_while_relayed_directly_ends_with_one_error_event(spy):
    async with fleet(decode_tps=400) as f:
        for d in f.decodes:
            d.set_faults(close_after_tokens=10)
        outcomes = await drive(f, 4, stream=True, chat=False, max_tokens=40)
        assert all(o.status == 200 and o.error == "BadGatewayError" for o in outcomes)
        assert spy.events >= 4 * 5  # tokens went direct before the engine died
        for o in outcomes:
            events = _events(o.body)
            assert events[-1] == b"[DONE]" and b'"error"' in events[-2]
            assert all(b'"error"' not in e for e in events[:-2])
        await assert_settled(f)


async def test_decode_hung_while_relayed_directly_is_ended_by_the_watchdog(spy):
    async with fleet(decode_tps=400, proxy=NO_MIGRATION) as f:
        for d in f.decodes:
            d.set_faults(hang_after_tokens=6)
        outcomes = await drive(f, 4, stream=True, chat=False, max_tokens=40)
        assert all(o.status == 200 and o.error == "GatewayTimeoutError" for o in outcomes)
        assert max(o.seconds for o in outcomes) < 2.0 + 2.0  # read timeout + watchdog tick
        assert spy.events >= 4 * 3
        await assert_settled(f)


async def test_client_leaving_while_relayed_directly_aborts_the_decode(spy):
    async with fleet(decode_tps=100) as f:
        _, writer = await asyncio.open_connection(*_host_port(f.proxy.url))
        writer.write(_post(body(0, stream=True, chat=False, max_tokens=400)))
        await wait_until(lambda: spy.events >= 5, timeout=5, what="tokens relayed directly")
        writer.close()
        await writer.wait_closed()
        await assert_settled(f)
        outcomes = [r.outcome for d in f.decodes for r in d.generation_requests()]
        assert outcomes == ["client_disconnected"]


async def test_a_client_that_stops_reading_gets_every_byte_once_it_reads_again(spy):
    """The client's socket fills: the writer declines (uvicorn's flow control paused
    writing), the stream goes back through ``send`` and its drain, then direct again."""
    spy.send_buffer = 4096
    async with fleet(decode_tps=0) as f:  # tokens as fast as the sim can write them
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(_host_port(f.proxy.url))
        sock.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(_post(body(0, stream=True, chat=False, max_tokens=3000)))
        await wait_until(lambda: spy.declined >= 1, timeout=10, what="the writer declining")
        raw = await asyncio.wait_for(reader.read(), 20)  # reads again, to the end
        writer.close()
        await writer.wait_closed()
        head, _, chunked = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        events = _events(_unchunk(chunked))
        assert events[-1] == b"[DONE]"
        assert len(events) == 3000 + 1
        assert all(b'"error"' not in e for e in events)
        assert spy.written >= 1 and spy.declined >= 1
        await assert_settled(f)


async def test_drain_past_its_grace_ends_a_direct_stream_with_one_error_event(spy):
    async with fleet(decode_tps=50) as f:
        request = asyncio.create_task(drive(f, 2, stream=True, chat=False, max_tokens=400))
        await wait_until(lambda: spy.events >= 4, timeout=5, what="tokens relayed directly")
        await f.state.lifecycle.drain(0.05)
        outcomes = await asyncio.wait_for(request, 10)
        assert all(o.status == 200 and o.error == "ServiceUnavailableError" for o in outcomes)
        await assert_settled(f)


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _post(payload: dict) -> bytes:
    data = orjson.dumps(payload)
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: pdproxy\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%b" % (len(data), data)
    )


def _unchunk(data: bytes) -> bytes:
    out = bytearray()
    while True:
        size_line, _, rest = data.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return bytes(out)
        out += rest[:size]
        assert rest[size : size + 2] == b"\r\n"
        data = rest[size + 2 :]
