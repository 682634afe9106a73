"""/metrics of a real pdproxy, after requests through sim PD pairs (streamed, whole, and
failed then retried on another decode), holds exactly the committed metric families with
their label sets (tests/unit/metrics_contract.txt), and the per-instance series count the
legs where they went."""

from __future__ import annotations

import aiohttp

from tests.integration.conftest import MODEL, deployment
from tests.metrics_contract import load_contract, parse_exposition

BODY = {"model": MODEL, "prompt": "metrics for an SRE", "max_tokens": 6}

# What the requests below must have produced, so the label checks are not vacuous.
MUST_HAVE_SAMPLES = {
    "pdproxy_requests_total",
    "pdproxy_request_ttft_seconds",
    "pdproxy_request_duration_seconds",
    "pdproxy_prefill_duration_seconds",
    "pdproxy_decode_headers_seconds",
    "pdproxy_kv_handoff_seconds",
    "pdproxy_endpoint_requests_total",
    "pdproxy_endpoint_failures_total",
    "pdproxy_endpoint_in_flight",
    "pdproxy_endpoint_healthy",
    "pdproxy_retries_total",
}


async def _post(s: aiohttp.ClientSession, url: str, stream: bool) -> int:
    async with s.post(url + "/v1/completions", json={**BODY, "stream": stream}) as r:
        await r.read()
        return r.status


async def _scrape(s: aiohttp.ClientSession, url: str) -> str:
    async with s.get(url + "/metrics") as r:
        return await r.text()


def _retried(text: str) -> bool:
    return _value(text, 'pdproxy_retries_total{leg="decode",reason="5xx"}') >= 1


def _value(text: str, prefix: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
    )


async def test_metrics_match_the_committed_contract():
    async with deployment(n_prefill=1, n_decode=2) as d, aiohttp.ClientSession() as s:
        url = d.proxy.url
        assert await _post(s, url, stream=True) == 200
        assert await _post(s, url, stream=False) == 200
        d.decodes[0].set_faults(status=500)  # its legs fail and are retried on the other
        for _ in range(10):  # until the scheduler has sent a leg to it
            assert await _post(s, url, stream=True) == 200
            if _retried(await _scrape(s, url)):
                break
        d.decodes[0].clear_faults()
        text = await _scrape(s, url)

    types, samples = parse_exposition(text)
    contract = load_contract()
    exposed = {name for name in types if name.startswith("pdproxy_")}
    assert exposed == set(contract), "update tests/unit/metrics_contract.txt and the docs"
    for name, family in contract.items():
        assert types[name] == family.type, name
        for labels in samples.get(name, ()):
            assert labels == family.labels, (name, sorted(labels))
    assert {name for name, sets in samples.items() if sets} >= MUST_HAVE_SAMPLES

    failing = d.decodes[0].url
    assert (
        _value(
            text, f'pdproxy_endpoint_failures_total{{reason="5xx",role="decode",url="{failing}"}}'
        )
        >= 1
    )
    assert (
        _value(text, f'pdproxy_endpoint_requests_total{{role="prefill",url="{d.prefills[0].url}"}}')
        >= 3
    )
    assert _retried(text)
    requests = _value(text, 'pdproxy_requests_total{endpoint="/v1/completions",outcome="ok"}')
    assert (
        _value(text, 'pdproxy_request_ttft_seconds_count{endpoint="/v1/completions"}') == requests
    )
