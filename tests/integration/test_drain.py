"""Graceful drain of a real pdproxy process on SIGTERM (sims on this loop, pdproxy in its
own process so the signal is real): /ready turns 503 at once, new requests are refused,
streams in flight finish within --shutdown-timeout-secs or end with one error event, and
the process exits 0."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time

import aiohttp
import orjson

from bench.procs import process
from engines.ports import free_port
from engines.sim import SimConfig, running_sim
from tests.integration.conftest import MODEL
from tests.sim.helpers import wait_for

STREAM = {"model": MODEL, "prompt": "drain me gently", "max_tokens": 20, "stream": True}


@contextlib.asynccontextmanager
async def proxy_process(grace: float, log_path):
    async with (
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        running_sim(SimConfig(role="decode", model=MODEL, decode_tps=10)) as d,
    ):
        port = free_port()
        args = [sys.executable, "-m", "pdproxy", "--host", "127.0.0.1", "--port", str(port)]
        args += ["--prefill", p.url, "--decode", d.url, "--shutdown-timeout-secs", str(grace)]
        with process(args, str(log_path)) as proc:
            url = f"http://127.0.0.1:{port}"
            await _until_ready(url)
            yield proc, url, d


async def _until_ready(url: str) -> None:
    async with aiohttp.ClientSession() as s:
        for _ in range(300):
            with contextlib.suppress(aiohttp.ClientError):
                async with s.get(url + "/ready") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.05)
    raise AssertionError("pdproxy did not become ready")


async def _stream(session, url):
    async with session.post(url + "/v1/completions", json=STREAM) as r:
        return r.status, await r.read()


async def _exit_code(proc, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        assert time.monotonic() < deadline, "pdproxy did not exit in time"
        await asyncio.sleep(0.05)
    return proc.returncode


async def test_sigterm_lets_streams_finish_refuses_new_ones_and_exits_0(tmp_path):
    async with proxy_process(10, tmp_path / "proxy.log") as (proc, url, decode):
        async with aiohttp.ClientSession() as s:
            streams = [asyncio.create_task(_stream(s, url)) for _ in range(20)]
            await wait_for(lambda: len(decode.generation_requests()) == 20)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.2)
            async with s.get(url + "/ready") as r:
                assert r.status == 503 and orjson.loads(await r.read())["reason"] == "draining"
            async with s.post(url + "/v1/completions", json=STREAM) as r:
                assert r.status == 503
                assert orjson.loads(await r.read())["error"]["type"] == "ServiceUnavailableError"
            results = await asyncio.gather(*streams)
        assert all(status == 200 for status, _ in results)
        assert all(
            raw.rstrip().endswith(b"data: [DONE]") and b'"error"' not in raw for _, raw in results
        )
        assert await _exit_code(proc, 10) == 0
        assert time.monotonic() - signalled < 10


async def test_a_grace_shorter_than_the_streams_ends_each_with_one_error_event(tmp_path):
    async with proxy_process(0.5, tmp_path / "proxy.log") as (proc, url, decode):
        async with aiohttp.ClientSession() as s:
            streams = [asyncio.create_task(_stream(s, url)) for _ in range(5)]
            await wait_for(lambda: len(decode.generation_requests()) == 5)
            proc.send_signal(signal.SIGTERM)
            results = await asyncio.gather(*streams)
        for status, raw in results:
            assert status == 200
            events = [e for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
            errors = [e for e in events if b'"error"' in e]
            assert len(errors) == 1 and b"shutting down" in errors[0]
            assert events[-1] == b"data: [DONE]"
        assert await _exit_code(proc, 10) == 0
        # the decode saw its legs closed: nothing left running there
        await wait_for(lambda: all(r.outcome != "pending" for r in decode.generation_requests()))
