"""The sim serves HTTPS and mTLS as vLLM's --ssl-* flags make it; kill and restart still work."""

from __future__ import annotations

import asyncio
import re
import signal
import ssl
import subprocess
import sys
from typing import Any

import aiohttp
import pytest

from engines.sim import SimConfig, running_sim
from engines.sim.cli import build_parser, config_from_args
from tests.certs import CertPaths, tls_certs  # noqa: F401  (the certs fixture)
from tests.sim.helpers import CHAT, COMPLETIONS, body_for, post, wait_for


def _https(certs: CertPaths, **overrides: Any) -> SimConfig:
    return SimConfig(ssl_certfile=certs.server_cert, ssl_keyfile=certs.server_key, **overrides)


def _mtls(certs: CertPaths, **overrides: Any) -> SimConfig:
    return _https(certs, ssl_ca_certs=certs.ca, ssl_cert_reqs=2, **overrides)


def _client(
    certs: CertPaths, *, cafile: str | None = None, cert: bool = False
) -> aiohttp.ClientSession:
    context = ssl.create_default_context(cafile=cafile or certs.ca)
    if cert:
        context.load_cert_chain(certs.client_cert, certs.client_key)
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=context))


async def test_https_serves_clients_that_trust_its_ca(certs):
    async with running_sim(_https(certs)) as sim, _client(certs) as session:
        assert sim.url == f"https://127.0.0.1:{sim.port}"
        async with session.get(sim.url + "/health") as resp:
            assert resp.status == 200
        status, _ = await post(session, sim.url + CHAT, body_for(CHAT))
        assert status == 200


async def test_https_refuses_plain_http_and_untrusting_clients(certs):
    async with running_sim(_https(certs)) as sim:
        plain = sim.url.replace("https://", "http://")
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.ClientError):
                await post(session, plain + COMPLETIONS, body_for(COMPLETIONS))
        async with _client(certs, cafile=certs.rogue_ca) as session:
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await post(session, sim.url + COMPLETIONS, body_for(COMPLETIONS))
        assert sim.requests == []


async def test_mtls_requires_a_client_certificate(certs):
    async with running_sim(_mtls(certs)) as sim:
        async with _client(certs) as session:
            # TLS 1.3: the server rejects the certificate after the client's handshake ends,
            # so the client learns of it (a reset) when it reads; the request was never read.
            with pytest.raises(aiohttp.ClientError):
                await post(session, sim.url + COMPLETIONS, body_for(COMPLETIONS))
        assert sim.requests == []
        async with _client(certs, cert=True) as session:
            status, _ = await post(session, sim.url + COMPLETIONS, body_for(COMPLETIONS))
        assert status == 200 and len(sim.generation_requests()) == 1


async def test_kill_and_restart_keep_tls(certs):
    async with running_sim(_mtls(certs, decode_tps=50)) as sim, _client(certs, cert=True) as s:
        url = sim.url
        streamed = asyncio.create_task(post(s, url + CHAT, body_for(CHAT, 100, stream=True)))
        await wait_for(lambda: sim.gauges().running == 1)
        await sim.kill()
        assert isinstance(
            (await asyncio.wait_for(asyncio.gather(streamed, return_exceptions=True), 1))[0],
            aiohttp.ClientError,
        )
        with pytest.raises(aiohttp.ClientConnectorError):
            await post(s, url + COMPLETIONS, body_for(COMPLETIONS))
        await sim.restart()
        assert sim.url == url
        status, _ = await post(s, url + COMPLETIONS, body_for(COMPLETIONS))
        assert status == 200


async def test_refuse_and_restore_keep_tls(certs):
    async with running_sim(_https(certs)) as sim, _client(certs) as session:
        sim.set_faults(refuse_connections=True)
        with pytest.raises(aiohttp.ClientConnectorError):
            await post(session, sim.url + COMPLETIONS, body_for(COMPLETIONS))
        sim.clear_faults()
        await wait_for(lambda: sim._server._listener is not None)
        status, _ = await post(session, sim.url + COMPLETIONS, body_for(COMPLETIONS))
        assert status == 200


def test_tls_flags_map_to_config():
    args = build_parser().parse_args(
        [
            "--ssl-keyfile=k.pem",
            "--ssl-certfile=c.pem",
            "--ssl-ca-certs=ca.pem",
            "--ssl-cert-reqs=2",
        ]
    )
    cfg = config_from_args(args)
    assert (cfg.ssl_keyfile, cfg.ssl_certfile, cfg.ssl_ca_certs) == ("k.pem", "c.pem", "ca.pem")
    assert cfg.ssl_cert_reqs == 2 and cfg.tls
    plain = config_from_args(build_parser().parse_args([]))
    assert (plain.ssl_certfile, plain.ssl_cert_reqs, plain.tls) == (None, 0, False)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--ssl-cert-reqs=3"])


@pytest.mark.parametrize(
    "fields",
    [
        {"ssl_certfile": "c.pem"},  # no key
        {"ssl_keyfile": "k.pem"},  # no certificate
        {"ssl_certfile": "c.pem", "ssl_keyfile": "k.pem", "ssl_cert_reqs": 2},  # no CA
        {"ssl_certfile": "c.pem", "ssl_keyfile": "k.pem", "ssl_cert_reqs": 5},
    ],
)
def test_inconsistent_tls_settings_are_refused(fields):
    with pytest.raises(ValueError, match="ssl_"):
        SimConfig(**fields)


async def test_standalone_process_serves_https(certs):
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "engines.sim",
        "--port=0",
        f"--ssl-certfile={certs.server_cert}",
        f"--ssl-keyfile={certs.server_key}",
        f"--ssl-ca-certs={certs.ca}",
        "--ssl-cert-reqs=2",
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        line = await asyncio.wait_for(proc.stderr.readline(), 20)
        match = re.search(rb"listening on (https://\S+) ", line)
        assert match, line
        url = match.group(1).decode()
        async with _client(certs, cert=True) as session, session.get(url + "/health") as resp:
            assert resp.status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0


def test_standalone_process_refuses_tls_files_that_do_not_load(tmp_path):
    missing = str(tmp_path / "absent.pem")
    tls = [f"--ssl-certfile={missing}", f"--ssl-keyfile={missing}"]
    done = subprocess.run(
        [sys.executable, "-m", "engines.sim", "--port=0", *tls],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1
    assert "cannot load the --ssl-* files: No such file or directory" in done.stderr
