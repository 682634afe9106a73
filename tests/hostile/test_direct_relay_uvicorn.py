"""The direct relay (pdproxy/api/direct.py) against the installed uvicorn (issue 19 item 6).

It reads uvicorn's private ``RequestResponseCycle``. These tests fail in ``make test`` the
day a uvicorn upgrade moves or reshapes it (the message says what changed: streams would
silently fall back to ASGI, at about twice the Python per token). They also show that the
fast path is taken with TLS on, through pdproxy's own listener, and that without it
pdproxy still starts and streams through ASGI.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ssl
import subprocess
import sys
import types
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
import uvicorn

import pdproxy.api.openai as openai_api
from pdproxy.api.direct import (
    CYCLE_CLASS,
    CYCLE_MODULE,
    _Held,
    cycle_class,
    direct_writer,
    fast_path_problem,
    send_together,
    when_lost,
)
from pdproxy.config.listener import ListenerTLS
from pdproxy.config.proxy import ProxyConfig
from pdproxy.runtime.server import uvicorn_config
from pdproxy.types import EngineAddress
from tests.certs import CertPaths, tls_certs  # noqa: F401  (the certs fixture)
from tests.integration.conftest import MODEL, deployment


def _changed() -> str:
    return (
        f"uvicorn {uvicorn.__version__} no longer offers pdproxy's direct relay"
        f" ({fast_path_problem() or 'its cycle is not what pdproxy/api/direct.py reads'}):"
        " streams fall back to ASGI; update pdproxy/api/direct.py and pyproject's bound"
    )


async def _app(scope, receive, send) -> None:
    """Starts a chunked answer, writes one chunk directly if it may, ends through ASGI."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    write = direct_writer(send)
    direct = write is not None and write(b"direct,")
    await send({"type": "http.response.body", "body": b"asgi:%d" % direct, "more_body": False})


@contextlib.asynccontextmanager
async def _uvicorn(tls: ListenerTLS | None = None) -> AsyncIterator[str]:
    """``_app`` under pdproxy's own uvicorn settings (its listener protocol)."""
    tls = tls or ListenerTLS()
    config = ProxyConfig(
        prefill=(EngineAddress(url="http://127.0.0.1:1"),),
        decode=(EngineAddress(url="http://127.0.0.1:2"),),
        tls=tls,
    )
    local = dataclasses.replace(config, host="127.0.0.1", port=0)
    server = uvicorn.Server(uvicorn_config(_app, local, loop="none", lifespan="off"))
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(500):
            if server.started or task.done():
                break
            await asyncio.sleep(0.01)
        assert server.started
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"{'https' if tls.enabled else 'http'}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)


def _listener(certs: CertPaths) -> ListenerTLS:
    return ListenerTLS(keyfile=certs.server_key, certfile=certs.server_cert)


def _client_context(certs: CertPaths) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=certs.ca)


async def _get(url: str, context: ssl.SSLContext | None = None) -> bytes:
    connector = aiohttp.TCPConnector(ssl=context if context is not None else True)
    async with aiohttp.ClientSession(connector=connector) as s, s.get(url) as r:
        assert r.status == 200
        return await r.read()


def test_the_installed_uvicorn_still_has_what_the_fast_path_reads():
    assert fast_path_problem() is None, _changed()
    assert cycle_class() is not None, _changed()


async def test_a_real_uvicorn_cycle_gets_a_direct_writer():
    async with _uvicorn() as url:
        assert await _get(url) == b"direct,asgi:1", _changed()


async def test_uvicorn_offers_it_with_tls_on(certs):
    async with _uvicorn(_listener(certs)) as url:
        assert await _get(url, _client_context(certs)) == b"direct,asgi:1", _changed()


async def test_a_stream_through_pdproxy_over_tls_goes_direct(certs, monkeypatch):
    writers, taken = [], []

    def spying(send):
        write = direct_writer(send)
        writers.append(write is not None)
        if write is None:
            return None

        def counted(chunk: bytes) -> bool:
            taken.append(write(chunk))
            return taken[-1]

        return counted

    monkeypatch.setattr(openai_api, "direct_writer", spying)
    body = {"model": MODEL, "prompt": "over tls", "max_tokens": 12, "stream": True}
    # tokens 5 ms apart: the first chunk starts the answer, the others may go direct
    async with deployment(1, 1, proxy={"tls": _listener(certs)}, decode_tps=200) as d:
        connector = aiohttp.TCPConnector(ssl=_client_context(certs))
        async with (
            aiohttp.ClientSession(connector=connector) as s,
            s.post(d.proxy.url + "/v1/completions", json=body) as r,
        ):
            raw = await r.read()
    assert d.proxy.url.startswith("https://") and r.status == 200
    assert writers == [True], _changed()
    assert sum(taken) >= 5, taken  # tokens went into the TLS transport directly
    events = [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"[DONE]" and len(events) == 12 + 1
    assert all(orjson.loads(e)["choices"][0]["text"] for e in events[:-1])


def test_a_moved_cycle_costs_the_fast_path_never_the_start_or_a_stream():
    assert cycle_class(CYCLE_MODULE, "Moved") is None
    assert fast_path_problem(CYCLE_MODULE, "Moved") == f"uvicorn's {CYCLE_MODULE} has no Moved"
    assert "has no" in (fast_path_problem("uvicorn.protocols.http.gone", CYCLE_CLASS) or "")

    class Send:  # a send bound to something else than uvicorn's own cycle
        async def send(self, message) -> None:
            pass

    assert direct_writer(Send().send) is None
    # A uvicorn without the module at all: the app imports, the relay says why it is off.
    code = (
        f"import sys; sys.modules[{CYCLE_MODULE!r}] = None\n"
        "import pdproxy.app, pdproxy.api.direct as d\n"
        "print(d.fast_path_problem())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"uvicorn has no {CYCLE_MODULE}"


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.written.append(data)


def _bare_cycle(**fields):
    """uvicorn's own cycle class, its fields set by hand (its __init__ is not run)."""
    cls = cycle_class()
    assert cls is not None, _changed()
    cycle = cls.__new__(cls)
    for name, value in fields.items():
        setattr(cycle, name, value)
    return cycle


def _fields() -> dict:
    return {
        "transport": _Transport(),
        "flow": types.SimpleNamespace(write_paused=False),
        "disconnected": False,
        "chunked_encoding": True,
        "response_complete": False,
    }


def test_a_cycle_with_every_field_gets_a_writer_in_chunked_framing():
    fields = _fields()
    write = direct_writer(_bare_cycle(**fields).send)
    assert write is not None and write(b"token")
    assert fields["transport"].written == [b"5\r\ntoken\r\n"]
    fields["flow"].write_paused = True  # the client's socket is full: back to send
    assert not write(b"more")


@pytest.mark.parametrize("missing", ["transport", "flow", "disconnected", "chunked_encoding"])
def test_a_cycle_missing_a_field_is_no_fast_path(missing):
    fields = _fields()
    del fields[missing]
    assert direct_writer(_bare_cycle(**fields).send) is None
    assert direct_writer(_bare_cycle(**{**_fields(), "flow": object()}).send) is None


_WRITES: list[bytes] = []


async def _together_app(scope, receive, send) -> None:
    """Sends its start and first body together, counting the connection's writes."""
    if scope["type"] != "http":
        return
    cycle, real = send.__self__, send.__self__.transport

    class Counting:
        def write(self, data: bytes) -> None:
            _WRITES.append(data)
            real.write(data)

        def __getattr__(self, name: str):
            return getattr(real, name)

    cycle.transport = Counting()
    streamed = scope["path"] == "/stream"
    headers = [] if streamed else [(b"content-length", b"5")]
    start = {"type": "http.response.start", "status": 200, "headers": headers}
    first = {"type": "http.response.body", "body": b"first", "more_body": streamed}
    await send_together(send, start, first)
    if streamed:
        await send({"type": "http.response.body", "body": b",last"})


@pytest.mark.parametrize("path", ["/whole", "/stream"])
async def test_a_response_start_and_its_first_body_are_one_write(path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "_app", _together_app)
    _WRITES.clear()
    async with _uvicorn() as url:
        body = await _get(url + path)
    assert body == (b"first,last" if path == "/stream" else b"first")
    head_and_first = _WRITES[0]
    assert head_and_first.startswith(b"HTTP/1.1 200 OK\r\n"), _changed()
    assert head_and_first.endswith(b"\r\n5\r\nfirst\r\n" if path == "/stream" else b"\r\n\r\nfirst")
    assert len(_WRITES) == (2 if path == "/stream" else 1)


async def test_any_other_send_gets_two_plain_sends():
    sent = []

    async def send(message) -> None:
        sent.append(message["type"])

    start = {"type": "http.response.start", "status": 200, "headers": []}
    await send_together(send, start, {"type": "http.response.body", "body": b"x"})
    assert sent == ["http.response.start", "http.response.body"]


def test_a_held_write_goes_out_before_the_transport_is_used_otherwise():
    transport = _Transport()
    calls = []
    transport.close = lambda: calls.append(list(transport.written))  # type: ignore[attr-defined]
    held = _Held(transport)
    held.write(b"head,")
    held.write(b"body")
    assert transport.written == []
    held.close()  # uvicorn closes a connection that does not keep alive
    assert calls == [[b"head,body"]]
    held.flush()
    assert transport.written == [b"head,body"]  # nothing twice


_LOST: dict[str, object] = {}


async def _lost_app(scope, receive, send) -> None:
    """Registers for the connection's loss, then waits (as a request waits on its legs)."""
    if scope["type"] != "http":
        return
    told = asyncio.get_running_loop().create_future()
    _LOST["registered"] = when_lost(send, lambda: told.set_result(True))
    _LOST["told"] = told
    await asyncio.sleep(30)


async def _leave_mid_request(url: str) -> None:
    host, port = url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"GET / HTTP/1.1\r\nHost: p\r\n\r\n")
    await writer.drain()
    for _ in range(200):  # the app has registered
        if "told" in _LOST:
            break
        await asyncio.sleep(0.01)
    writer.close()


async def test_pdproxys_listener_tells_a_handler_its_client_left(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "_app", _lost_app)
    _LOST.clear()
    async with _uvicorn() as url:
        await _leave_mid_request(url)
        assert _LOST["registered"] is True
        assert await asyncio.wait_for(_LOST["told"], 5) is True  # no task in receive()


async def test_under_another_protocol_the_handler_reads_receive_instead():
    _LOST.clear()
    config = uvicorn.Config(_lost_app, host="127.0.0.1", port=0, lifespan="off", log_level="error")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(500):
            if server.started:
                break
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        await _leave_mid_request(f"http://127.0.0.1:{port}")
        assert _LOST["registered"] is False  # uvicorn's own protocol never calls it
    finally:
        server.should_exit = True
        server.force_exit = True
        await asyncio.wait_for(task, 10)
