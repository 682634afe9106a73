"""No key (admin, client, engine) ever appears in a log line at any level, an error body,
/status or /metrics. A real pdproxy process at debug level with its access log on is driven
through right and wrong keys, the admin API and failing engines; then every byte it wrote
and every answer it gave is searched for each key."""

from __future__ import annotations

import sys

import aiohttp

from bench.procs import process
from engines.ports import free_port
from engines.sim import SimConfig, running_sim
from tests.integration.conftest import MODEL
from tests.integration.test_drain import _until_ready

ADMIN_KEY = "adm-7c1e9f0b2d"
CLIENT_KEY = "cli-5a8d3e6f41"
ENGINE_KEY = "eng-0b9c4d2a77"
SECRETS = (ADMIN_KEY, CLIENT_KEY, ENGINE_KEY)
BODY = {"model": MODEL, "prompt": "where do the keys go", "max_tokens": 4}


async def _exercise(s: aiohttp.ClientSession, url: str, decode) -> list[bytes]:
    """Every kind of answer, right and wrong keys alike; returns the bodies."""
    bodies = []

    async def call(method: str, path: str, **kw) -> None:
        async with s.request(method, url + path, **kw) as r:
            bodies.append(await r.read())

    for auth in (f"Bearer {CLIENT_KEY}", f"Bearer {CLIENT_KEY}x", CLIENT_KEY, None):
        headers = {"Authorization": auth} if auth else {}
        for stream in (False, True):
            await call("POST", "/v1/completions", json={**BODY, "stream": stream}, headers=headers)
        await call("GET", "/v1/models", headers=headers)
    decode.set_faults(status=500)  # failing engines: error bodies and warnings
    await call(
        "POST", "/v1/completions", json=BODY, headers={"Authorization": f"Bearer {CLIENT_KEY}"}
    )
    decode.clear_faults()
    for key in (ADMIN_KEY, ADMIN_KEY + "x", ENGINE_KEY, CLIENT_KEY):
        await call("GET", "/instances", headers={"X-API-Key": key})
        await call(
            "POST",
            "/instances/add",
            json={"type": "decode", "instance": "127.0.0.1:1"},
            headers={"X-API-Key": key},
        )
    for path in ("/status", "/metrics", "/health", "/ready"):
        await call("GET", path)
    return bodies


async def test_no_key_in_any_log_line_body_status_or_metrics(tmp_path):
    admin_file, client_file, engine_file = (tmp_path / n for n in ("admin", "client", "engine"))
    admin_file.write_text(ADMIN_KEY)
    client_file.write_text(CLIENT_KEY + "\n")
    engine_file.write_text(ENGINE_KEY)
    log_path = tmp_path / "pdproxy.log"
    async with (
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        running_sim(SimConfig(role="decode", model=MODEL)) as d,
    ):
        port = free_port()
        args = [sys.executable, "-m", "pdproxy", "--host", "127.0.0.1", "--port", str(port)]
        args += ["--prefill", p.url, "--decode", d.url, "--log-level", "debug", "--access-log"]
        args += ["--admin-api-key-file", str(admin_file), "--api-key-file", str(client_file)]
        args += ["--engine-api-key-file", str(engine_file), "--max-retries", "0"]
        with process(args, str(log_path)):
            url = f"http://127.0.0.1:{port}"
            await _until_ready(url)
            async with aiohttp.ClientSession() as s:
                bodies = await _exercise(s, url, d)
        # the engines did get the engine key, so the search below is not vacuous
        assert any(
            r.headers.get("authorization") == f"Bearer {ENGINE_KEY}"
            for r in d.generation_requests()
        )
    log = log_path.read_bytes()
    assert b"DEBUG" in log and b"/v1/completions" in log  # it logged, at every level
    for secret in SECRETS:
        assert secret.encode() not in log, f"{secret} in the log"
        for body in bodies:
            assert secret.encode() not in body, f"{secret} in an answer: {body[:200]!r}"
