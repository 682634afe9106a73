"""HTTPS on both sides of pdproxy: clients → pdproxy (TLS, mTLS) and pdproxy → engines.

Certificates are made per module (``tests.certs``); every server is real, on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import ssl
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from engines.sim import SimConfig, running_sim
from pdproxy.config.listener import ListenerTLS
from pdproxy.config.resilience import HealthConfig
from pdproxy.config.upstream import EngineTLS, PoolLimits, Timeouts
from pdproxy.errors import ConfigError, UpstreamConnectError, UpstreamProtocolError
from pdproxy.upstream.engine_client import EngineClient
from tests.certs import CertPaths, tls_certs  # noqa: F401  (the certs fixture)
from tests.integration.conftest import MODEL, Deployment, deployment

BODY = {"model": MODEL, "prompt": "a certificate for every hop", "max_tokens": 4}
COMPLETIONS = "/v1/completions"
NO_HEALTH_CHECKS = HealthConfig(interval=0)
ANSWER_WITHIN = 10  # seconds: a TLS failure must give an answer, never a hang


def _context(
    certs: CertPaths, *, cafile: str | None = None, client_cert: bool = False, tls12: bool = False
) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=cafile or certs.ca)
    if client_cert:
        context.load_cert_chain(certs.client_cert, certs.client_key)
    if tls12:
        context.maximum_version = ssl.TLSVersion.TLSv1_2
    return context


async def _post(url: str, context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    connector = aiohttp.TCPConnector(ssl=context if context is not None else True)
    async with (
        aiohttp.ClientSession(connector=connector) as s,
        s.post(url + COMPLETIONS, json=BODY) as r,
    ):
        return r.status, await r.read()


def _listener(certs: CertPaths, cert_reqs: int = 0) -> ListenerTLS:
    return ListenerTLS(
        keyfile=certs.server_key,
        certfile=certs.server_cert,
        ca_certs=certs.ca if cert_reqs else None,
        cert_reqs=cert_reqs,
    )


def _sims(certs: CertPaths, *, mtls: bool = False, rogue: bool = False) -> dict[str, Any]:
    """SimConfig overrides: the P and D engines serve HTTPS (mTLS: client certs required)."""
    fields: dict[str, Any] = {
        "ssl_certfile": certs.rogue_server_cert if rogue else certs.server_cert,
        "ssl_keyfile": certs.rogue_server_key if rogue else certs.server_key,
    }
    if mtls:
        fields.update(ssl_ca_certs=certs.ca, ssl_cert_reqs=2)
    return fields


def _routable(d: Deployment) -> tuple[int, int]:
    snapshot = d.proxy.state.registry.snapshot()
    return len(snapshot.prefill), len(snapshot.decode)


def _error(raw: bytes) -> Any:
    return orjson.loads(raw)["error"]


# clients → pdproxy


async def test_https_clients_get_answers_through_the_fleet(certs):
    async with deployment(1, 1, proxy={"tls": _listener(certs)}) as d:
        assert d.proxy.url.startswith("https://127.0.0.1:")
        status, raw = await _post(d.proxy.url, _context(certs))
        assert status == 200 and orjson.loads(raw)["choices"][0]["text"]
        assert len(d.generation_requests(d.engines)) == 2  # one prefill, one decode


async def test_plain_http_and_untrusting_clients_fail(certs):
    async with deployment(1, 1, proxy={"tls": _listener(certs)}) as d:
        with pytest.raises(aiohttp.ClientError):
            await _post(d.proxy.url.replace("https://", "http://"))
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await _post(d.proxy.url, _context(certs, cafile=certs.rogue_ca))
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await _post(d.proxy.url)  # the system's CAs do not know the test CA
        assert d.generation_requests(d.engines) == []


@pytest.mark.parametrize("tls12", [False, True], ids=["tls1.3", "tls1.2"])
async def test_required_client_certificate(certs, tls12):
    async with deployment(1, 1, proxy={"tls": _listener(certs, cert_reqs=2)}) as d:
        # TLS 1.2: the server resets the handshake itself (a connect error). TLS 1.3 ends
        # the client's handshake before the server judges its certificate, so the refusal
        # (a reset) meets the client's first read. Either way the request is never read.
        expected = aiohttp.ClientConnectorError if tls12 else aiohttp.ClientConnectionError
        with pytest.raises(expected):
            await _post(d.proxy.url, _context(certs, tls12=tls12))
        assert d.generation_requests(d.engines) == []
        status, _ = await _post(d.proxy.url, _context(certs, client_cert=True, tls12=tls12))
        assert status == 200


async def test_openai_sdk_over_https(certs):
    async with deployment(1, 1, proxy={"tls": _listener(certs)}) as d:
        http_client = openai.DefaultAsyncHttpxClient(verify=_context(certs))
        client = openai.AsyncOpenAI(
            base_url=d.proxy.url + "/v1", api_key="sk-x", max_retries=0, http_client=http_client
        )
        async with client:
            answer = await client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
            assert answer.usage is not None and answer.usage.completion_tokens == 3
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
            )
            assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


# pdproxy → engines


@pytest.mark.parametrize("mtls", [False, True], ids=["https", "mtls"])
async def test_engines_behind_https_are_healthy_and_serve(certs, mtls):
    engine_tls = EngineTLS(
        ca_certs=certs.ca,
        certfile=certs.client_cert if mtls else None,
        keyfile=certs.client_key if mtls else None,
    )
    async with deployment(1, 1, proxy={"engine_tls": engine_tls}, **_sims(certs, mtls=mtls)) as d:
        assert all(e.url.startswith("https://") for e in d.engines)
        assert _routable(d) == (1, 1)  # the health probes passed over the same TLS settings
        status, _ = await _post(d.proxy.url)
        assert status == 200
        assert [len(e.generation_requests()) for e in d.engines] == [1, 1]


@pytest.mark.parametrize(
    ("case", "sims", "engine_tls"),
    [
        ("no client cert", {"mtls": True}, "ca"),
        ("untrusted engine", {"rogue": True}, "ca"),
        ("default verification", {}, None),
    ],
)
async def test_engines_refusing_tls_are_never_routable(certs, case, sims, engine_tls):
    """Health checks probe with the legs' TLS settings, so a misconfigured fleet is 503 at once."""
    tls = EngineTLS(ca_certs=certs.ca) if engine_tls == "ca" else EngineTLS()
    async with deployment(1, 1, proxy={"engine_tls": tls}, **_sims(certs, **sims)) as d:
        assert _routable(d) == (0, 0), case
        status, raw = await asyncio.wait_for(_post(d.proxy.url), ANSWER_WITHIN)
        assert status == 503 and _error(raw)["type"] == "ServiceUnavailableError"
        assert d.generation_requests(d.engines) == []


@pytest.mark.parametrize("rogue", [True, False], ids=["untrusted engine", "system CAs"])
async def test_engine_certificate_failure_is_a_503_connect_error(certs, rogue):
    """Without health checks the legs meet the failure: a connect error, retried, then 503."""
    tls = EngineTLS(ca_certs=certs.ca) if rogue else EngineTLS()
    proxy = {"engine_tls": tls, "health": NO_HEALTH_CHECKS}
    async with deployment(1, 1, proxy=proxy, **_sims(certs, rogue=rogue)) as d:
        status, raw = await asyncio.wait_for(_post(d.proxy.url), ANSWER_WITHIN)
        error = _error(raw)
        assert status == 503 and error["type"] == "ServiceUnavailableError"
        assert "TLS handshake with prefill engine" in error["message"]
        assert "CERTIFICATE_VERIFY_FAILED" in error["message"]
        assert d.generation_requests(d.engines) == []


async def test_missing_client_certificate_fails_the_legs_at_once(certs):
    """An asyncio or uvicorn engine (vLLM) resets a TLS 1.3 client it refuses after the
    client's handshake has ended, so the leg sees a reset: 502 after retries, never a hang."""
    proxy = {"engine_tls": EngineTLS(ca_certs=certs.ca), "health": NO_HEALTH_CHECKS}
    async with deployment(1, 1, proxy=proxy, **_sims(certs, mtls=True)) as d:
        status, raw = await asyncio.wait_for(_post(d.proxy.url), ANSWER_WITHIN)
        assert status == 502 and _error(raw)["type"] == "BadGatewayError"
        assert d.generation_requests(d.engines) == []


# EngineClient: the error mapping and the TLS files


@contextlib.asynccontextmanager
async def _engine_client(tls: EngineTLS) -> AsyncIterator[EngineClient]:
    client = EngineClient(Timeouts(connect=2, read=5, probe=2), PoolLimits(), tls=tls)
    await client.start()
    try:
        yield client
    finally:
        await client.aclose()


async def _post_leg(client: EngineClient, url: str) -> int:
    upstream, _ = await client.post_read(url + COMPLETIONS, orjson.dumps(BODY), {}, leg="prefill")
    return upstream.status


class _AlertingServer(asyncio.Protocol):
    """Refuses a client without a certificate as nginx does: it sends the TLS alert, reads
    what follows and closes (asyncio's server, as uvicorn's, resets the connection instead)."""

    def __init__(self, context: ssl.SSLContext) -> None:
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._in, self._out, server_side=True)
        self._failed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        if self._failed:
            return
        self._in.write(data)
        try:
            self._tls.do_handshake()
        except ssl.SSLWantReadError:
            pass
        except ssl.SSLError:
            self._failed = True
            asyncio.get_running_loop().call_later(0.1, self._transport.close)
        self._transport.write(self._out.read())


async def test_untrusted_engine_is_a_connect_error_and_sends_nothing(certs):
    sim_config = SimConfig(**_sims(certs, rogue=True))
    async with running_sim(sim_config) as sim, _engine_client(EngineTLS(ca_certs=certs.ca)) as c:
        with pytest.raises(UpstreamConnectError) as caught:
            await _post_leg(c, sim.url)
        # the legs' client (pdproxy.upstream.http1) failed the handshake on the certificate's check
        assert isinstance(caught.value.__cause__.__cause__, ssl.SSLCertVerificationError)
        assert "CERTIFICATE_VERIFY_FAILED" in str(caught.value)
        assert not await c.probe(sim.url + "/health", 2)
        assert sim.requests == []


async def test_a_refused_client_certificate_alert_is_a_connect_error(certs):
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs.server_cert, certs.server_key)
    context.load_verify_locations(certs.ca)
    context.verify_mode = ssl.CERT_REQUIRED
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _AlertingServer(context), "127.0.0.1", 0)
    url = f"https://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with _engine_client(EngineTLS(ca_certs=certs.ca)) as client:
            with pytest.raises(UpstreamConnectError, match="CERTIFICATE_REQUIRED"):
                await _post_leg(client, url)
    finally:
        server.close()
        await server.wait_closed()


async def test_a_reset_after_the_tls13_handshake_stays_a_protocol_error(certs):
    """The reset is all the client sees; it cannot tell it from a crash mid-request."""
    async with (
        running_sim(SimConfig(**_sims(certs, mtls=True))) as sim,
        _engine_client(EngineTLS(ca_certs=certs.ca)) as client,
    ):
        with pytest.raises(UpstreamProtocolError):
            await _post_leg(client, sim.url)
        assert sim.requests == []


async def test_client_certificate_reaches_an_mtls_engine(certs):
    tls = EngineTLS(ca_certs=certs.ca, certfile=certs.client_cert, keyfile=certs.client_key)
    async with (
        running_sim(SimConfig(**_sims(certs, mtls=True))) as sim,
        _engine_client(tls) as client,
    ):
        assert await _post_leg(client, sim.url) == 200
        assert await client.probe(sim.url + "/health", 2)
        assert await client.get_json(sim.url + "/v1/models")


def _key_line(path: str) -> str:
    return pathlib.Path(path).read_text().splitlines()[1]  # base64 of the key itself


@pytest.mark.parametrize("what", ["mismatched key", "missing CA", "not a certificate"])
async def test_tls_files_that_do_not_load_are_a_config_error(certs, tmp_path, what):
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    tls = {
        "mismatched key": EngineTLS(certfile=certs.client_cert, keyfile=certs.server_key),
        "missing CA": EngineTLS(ca_certs=str(tmp_path / "absent.pem")),
        "not a certificate": EngineTLS(ca_certs=str(garbage)),
    }[what]
    client = EngineClient(Timeouts(), PoolLimits(), tls=tls)
    with pytest.raises(ConfigError, match="cannot load --engine-") as caught:
        await client.start()
    message = str(caught.value)
    assert "PRIVATE KEY" not in message and _key_line(certs.server_key) not in message
    await client.aclose()
