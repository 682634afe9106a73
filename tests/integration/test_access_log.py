"""The access line, in-process: a disaggregated request names both legs, a decode-only one
says so and names no prefill, and ``access_log=False`` silences it."""

from __future__ import annotations

import logging

import aiohttp

from pdproxy.config.scheduling import SchedulingConfig
from tests.integration.conftest import MODEL, deployment

BODY = {"model": MODEL, "prompt": "short", "max_tokens": 3, "stream": True}


async def _post(url: str) -> bytes:
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=BODY) as r:
        assert r.status == 200
        return await r.read()


def _access(caplog) -> list[dict]:
    return [r.fields for r in caplog.records if r.name == "pdproxy.access"]


async def test_a_disaggregated_request_names_both_legs(caplog):
    caplog.set_level(logging.INFO, logger="pdproxy.access")
    async with deployment(n_prefill=1, n_decode=1) as d:
        body = await _post(d.proxy.url)
    [fields] = _access(caplog)
    assert (fields["prefill_url"], fields["decode_url"]) == (d.prefills[0].url, d.decodes[0].url)
    assert fields["decode_only"] is False and fields["bytes_sent"] == len(body)
    assert fields["outcome"] == "ok" and fields["retries"] == 0


async def test_a_decode_only_request_says_so(caplog):
    caplog.set_level(logging.INFO, logger="pdproxy.access")
    everything_short = {"scheduling": SchedulingConfig(pd_threshold_tokens=100_000)}
    async with deployment(n_prefill=1, n_decode=1, proxy=everything_short) as d:
        await _post(d.proxy.url)
        assert not d.prefills[0].generation_requests()
    [fields] = _access(caplog)
    assert fields["decode_only"] is True and fields["prefill_url"] is None
    assert fields["prefill_ms"] is None and fields["decode_url"] == d.decodes[0].url


async def test_no_access_log(caplog):
    caplog.set_level(logging.INFO, logger="pdproxy.access")
    async with deployment(n_prefill=1, n_decode=1, proxy={"access_log": False}) as d:
        await _post(d.proxy.url)
    assert _access(caplog) == []
