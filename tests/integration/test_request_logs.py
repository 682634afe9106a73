"""The JSON log of a real pdproxy process (``--log-format json`` at debug level): every line
it writes, uvicorn's included, is one JSON object; every line a request caused carries that
request's id; its access line has every field; and no line holds the prompt.

Health checks and engine scrapes are off, so between two requests nothing else logs."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import aiohttp

from bench.procs import process
from engines.ports import free_port
from engines.sim import SimConfig, running_sim
from tests.integration.conftest import MODEL
from tests.integration.test_drain import _until_ready

PROMPT = "zebra-quartz-47 walks into a log file"
BASE_KEYS = {"ts", "level", "logger", "msg", "request_id"}
ACCESS_FIELDS = {
    "endpoint",
    "status",
    "outcome",
    "prefill_url",
    "decode_url",
    "prefill_dp_rank",
    "retries",
    "prefill_sent_ms",
    "prefill_ms",
    "decode_sent_ms",
    "decode_headers_ms",
    "ttfb_ms",
    "total_ms",
    "bytes_sent",
    "decode_only",
    "migrations",
}


def _args(port: int, prefill: str, decode: str) -> list[str]:
    return [
        *(sys.executable, "-m", "pdproxy", "--host", "127.0.0.1", "--port", str(port)),
        *("--prefill", prefill, "--decode", decode, "--max-retries", "1"),
        *("--log-format", "json", "--log-level", "debug"),
        *("--health-check-interval-secs", "0", "--engine-metrics-interval-secs", "0"),
    ]


async def _request(s: aiohttp.ClientSession, url: str, request_id: str, stream: bool):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": stream}
    headers = {"X-Request-Id": request_id}
    async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
        return r.status, await r.read()


def _lines_from(log: Path, offset: int) -> list[dict]:
    return [json.loads(line) for line in log.read_bytes()[offset:].splitlines() if line.strip()]


def _check_access(line: dict, request_id: str, status: int, size: int, p, d) -> None:
    assert set(line) == BASE_KEYS | ACCESS_FIELDS, set(line) ^ (BASE_KEYS | ACCESS_FIELDS)
    assert line["level"] == "INFO" and line["request_id"] == request_id
    assert line["endpoint"] == "/v1/completions" and line["status"] == status
    assert (line["prefill_url"], line["decode_url"]) == (p.url, d.url)
    assert line["bytes_sent"] == size and line["decode_only"] is False
    assert 0 < line["ttfb_ms"] <= line["total_ms"]
    assert line["prefill_ms"] > 0 and line["decode_headers_ms"] > 0
    # the phases before the first byte, in order: each leg sent after the last one ended
    assert 0 <= line["prefill_sent_ms"] <= line["prefill_sent_ms"] + line["prefill_ms"]
    assert line["prefill_sent_ms"] + line["prefill_ms"] <= line["decode_sent_ms"] + 0.1
    assert line["decode_sent_ms"] + line["decode_headers_ms"] <= line["ttfb_ms"] + 0.1


async def test_json_log_names_the_request_on_every_line_and_never_the_prompt(tmp_path):
    log = tmp_path / "pdproxy.log"
    cases = (("obs-stream-1", True, None), ("obs-whole-2", False, None), ("obs-fail-3", True, 500))
    async with (
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        running_sim(SimConfig(role="decode", model=MODEL)) as d,
    ):
        port = free_port()
        with process(_args(port, p.url, d.url), str(log)):
            url = f"http://127.0.0.1:{port}"
            await _until_ready(url)
            async with aiohttp.ClientSession() as s:
                for request_id, stream, fault in cases:
                    offset = log.stat().st_size
                    if fault is not None:
                        d.set_faults(status=fault)
                    status, body = await _request(s, url, request_id, stream)
                    d.clear_faults()
                    await asyncio.sleep(0.3)  # background work the request started (KV release)
                    lines = _lines_from(log, offset)
                    assert lines and {line["request_id"] for line in lines} == {request_id}
                    access = [line for line in lines if line["logger"] == "pdproxy.access"]
                    assert len(access) == 1, lines
                    if fault is None:
                        assert status == 200
                        _check_access(access[0], request_id, status, len(body), p, d)
                    else:
                        assert status >= 500 and access[0]["retries"] == 1
                        assert access[0]["outcome"] != "ok" and access[0]["status"] == status
    text = log.read_text()
    assert PROMPT not in text and "zebra" not in text
    every = _lines_from(log, 0)
    assert all(set(line) >= BASE_KEYS for line in every)
    assert any(line["logger"].startswith("uvicorn") for line in every)  # uvicorn's own, as JSON
