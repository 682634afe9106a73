"""``GET /dashboard`` and its JSON, ``GET /dashboard/data``, against a 2P2D sim fleet behind
a real pdproxy: the shape, figures that follow the traffic and an instance that dies, the
page's own files (weight, CSP, nothing from another origin), ``--no-dashboard`` and keys;
the queue panel's ``flow``: null while flow control is off, ``/status``'s section when on."""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp
import pytest

from pdproxy.cli.main import parse_config
from pdproxy.config.listener import AdmissionConfig
from pdproxy.config.tenants import TenantsConfig, TenantSpec
from tests.faults.harness import MODEL, all_ok, drive, fleet, wait_until

KEY = "dashboard-test-key"
PAGE_FILES = (
    "/dashboard",
    "/dashboard/dashboard.css",
    "/dashboard/dashboard.js",
    "/dashboard/dom.js",
    "/dashboard/kv_events.js",
    "/dashboard/flow.js",
)
PAGE_BUDGET = 200 * 1024  # bytes, the whole page
# The only absolute URL the page's files may hold: SVG's namespace name, never fetched.
ALLOWED_ABSOLUTE = {"http://www.w3.org/2000/svg"}
# Absolute URLs, and protocol-relative ones in an attribute (src="//cdn...").
ABSOLUTE_URL = re.compile(r"""https?://[^\s"'<>)]+|(?:src|href|action)\s*=\s*["']//[^"']*""")

INSTANCE_FIELDS = {
    "role",
    "address",
    "url",
    "source",
    "state",
    "routable",
    "health",
    "breaker",
    "ejected",
    "ejected_for_seconds",
    "overloaded",
    "consecutive_failures",
    "ejections",
    "in_flight",
    "rank_in_flight",
    "engine_load",
    "dp_size",
    "models",
}
WINDOW_FIELDS = {
    "seconds",
    "requests",
    "errors",
    "requests_per_second",
    "errors_per_second",
    "error_ratio",
    "ttft_p50_seconds",
    "ttft_p99_seconds",
    "errors_by_outcome",
}


async def get(session: aiohttp.ClientSession, url: str, **kw):
    async with session.get(url, **kw) as r:
        return r.status, r.headers, await r.read()


async def data(session: aiohttp.ClientSession, base: str, **kw) -> dict:
    async with session.get(base + "/dashboard/data", **kw) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Cache-Control"] == "no-store"
        return await r.json()


async def eventually(s: aiohttp.ClientSession, base: str, predicate, *, timeout: float) -> dict:
    """The first answer of /dashboard/data that satisfies ``predicate``."""
    deadline = time.monotonic() + timeout
    while True:
        d = await data(s, base)
        if predicate(d) or time.monotonic() > deadline:
            return d
        await asyncio.sleep(0.1)


async def test_data_lists_every_instance_with_its_state():
    async with fleet() as f, aiohttp.ClientSession() as s:
        d = await data(s, f.proxy.url)

        assert d["schema"] == 1
        assert set(d) == {
            *("schema", "proxy", "instances", "window", "series", "totals", "models"),
            *("kv_events", "flow"),
        }
        assert d["kv_events"] is None  # no engine's KV events configured
        assert d["flow"] is None  # no tenants file nor tenant header: flow control off
        assert d["proxy"]["ready"] is True and d["proxy"]["kv_connector"] == "nixl"
        assert d["proxy"]["in_flight"] == 0 and d["proxy"]["uptime_seconds"] >= 0
        instances = d["instances"]
        assert [i["role"] for i in instances] == ["decode", "decode", "prefill", "prefill"]
        assert {i["url"] for i in instances} == {e.url for e in f.engines}
        for i in instances:
            assert set(i) >= INSTANCE_FIELDS, INSTANCE_FIELDS - set(i)
            assert (i["state"], i["health"], i["breaker"]) == ("ready", "healthy", "closed")
            assert i["routable"] is True and i["ejected"] is False and i["dp_size"] == 1
            assert i["source"] == "static" and i["in_flight"] == 0
            load = i["engine_load"]
            fields = {"running", "waiting", "kv_usage", "age_s", "fresh", "ranks"}
            assert load is None or set(load) >= fields, load
        assert set(d["window"]) >= WINDOW_FIELDS
        series = d["series"]
        assert series["step_seconds"] == 2 and series["span_seconds"] == 300
        columns = ("t", "requests_per_second", "errors_per_second")
        assert len({len(series[c]) for c in (*columns, "ttft_p50_seconds")}) == 1


async def test_engine_figures_show_once_scraped():
    async with fleet() as f, aiohttp.ClientSession() as s:
        d = await eventually(
            s, f.proxy.url, lambda d: all(i["engine_load"] for i in d["instances"]), timeout=5
        )
        for i in d["instances"]:
            load = i["engine_load"]
            assert load is not None, i["url"]
            assert load["fresh"] is True and load["age_s"] < 5
            assert load["running"] == 0 and 0 <= load["kv_usage"] <= 1


async def test_figures_follow_the_requests():
    async with fleet() as f, aiohttp.ClientSession() as s:
        before = await data(s, f.proxy.url)
        all_ok(await drive(f, 12))

        d = await data(s, f.proxy.url)

        ok_before = before["totals"]["requests"].get("ok", 0)
        assert d["totals"]["requests"]["ok"] == ok_before + 12
        window = d["window"]
        assert window["requests"] >= 12 and window["requests_per_second"] > 0
        assert window["errors"] == 0 and window["error_ratio"] == 0
        assert window["errors_by_outcome"] == {}
        assert d["proxy"]["uptime_seconds"] > before["proxy"]["uptime_seconds"]


async def test_ttft_quantiles_come_from_the_histogram():
    """Known observations in pdproxy's own TTFT histogram give Prometheus's quantiles."""
    async with fleet() as f, aiohttp.ClientSession() as s:
        before = (await data(s, f.proxy.url))["totals"]["ttft"]["count"]
        ttft = f.state.metrics.ttft_seconds.labels("/v1/completions")
        for _ in range(100):
            ttft.observe(0.03)  # all in the (0.025, 0.05] bucket

        d = await data(s, f.proxy.url)

        totals = d["totals"]["ttft"]
        assert totals["count"] == before + 100
        assert len(totals["bucket_counts"]) == len(totals["bucket_bounds"]) + 1
        assert totals["bucket_counts"][-1] == totals["count"]
        if before == 0:  # nothing else observed: the quantiles are exact
            assert d["window"]["ttft_p50_seconds"] == pytest.approx(0.0375)
            assert d["window"]["ttft_p99_seconds"] == pytest.approx(0.04975)
        else:
            assert 0.025 <= d["window"]["ttft_p50_seconds"] <= 0.05


async def test_a_killed_instance_shows_as_down_and_errors_are_counted():
    async with fleet() as f, aiohttp.ClientSession() as s:
        victim = f.decodes[0]
        await victim.kill()

        def row(d):
            return next(i for i in d["instances"] if i["url"] == victim.url)

        # health checks every 0.25 s: two failures in a row make it unhealthy
        latest = await eventually(
            s, f.proxy.url, lambda d: row(d)["health"] == "unhealthy", timeout=5
        )
        dead = row(latest)
        assert dead["health"] == "unhealthy" and dead["routable"] is False
        others = [i for i in latest["instances"] if i["url"] != victim.url]
        assert all(i["health"] == "healthy" for i in others)
        assert latest["proxy"]["ready"] is True  # the other decode still serves

        # Errors are counted per outcome: with both decodes gone, requests fail.
        await f.decodes[1].kill()
        outcomes = await drive(f, 4)
        assert all(not o.ok for o in outcomes)
        d = await data(s, f.proxy.url)
        assert d["window"]["errors"] >= 4 and d["window"]["errors_per_second"] > 0
        assert sum(d["window"]["errors_by_outcome"].values()) == d["window"]["errors"]
        assert d["window"]["error_ratio"] > 0


async def test_page_is_small_self_contained_and_locked_to_its_origin():
    async with fleet(n_prefill=1, n_decode=1) as f, aiohttp.ClientSession() as s:
        total = 0
        for path in PAGE_FILES:
            status, headers, body = await get(s, f.proxy.url + path)
            assert status == 200, path
            total += len(body)
            csp = headers["Content-Security-Policy"]
            assert "default-src 'none'" in csp and "connect-src 'self'" in csp
            assert "script-src 'self'" in csp and "unsafe-inline" not in csp
            assert headers["X-Content-Type-Options"] == "nosniff"
            text = body.decode("utf-8")
            urls = set(ABSOLUTE_URL.findall(text))
            assert urls <= ALLOWED_ABSOLUTE, (path, urls - ALLOWED_ABSOLUTE)
            assert "@import" not in text and "url(" not in text.replace("data:", "")
        assert total < PAGE_BUDGET, total
        status, headers, _ = await get(s, f.proxy.url + "/dashboard")
        assert headers["Content-Type"].startswith("text/html")


async def test_no_dashboard_serves_nothing():
    async with fleet(n_prefill=1, n_decode=1, proxy={"dashboard": False}) as f:
        async with aiohttp.ClientSession() as s:
            for path in (*PAGE_FILES, "/dashboard/data"):
                status, _, _ = await get(s, f.proxy.url + path)
                assert status == 404, path
        sampler = "Dashboard._run"
        assert not any(
            getattr(t.get_coro(), "__qualname__", "") == sampler for t in asyncio.all_tasks()
        )


async def test_data_needs_a_key_exactly_when_metrics_do():
    keys = {"api_keys": (KEY,)}
    bearer = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession() as s:
        async with fleet(n_prefill=1, n_decode=1, proxy={**keys, "protect_metrics": True}) as f:
            for path in ("/metrics", "/dashboard/data"):
                status, _, body = await get(s, f.proxy.url + path)
                assert status == 401, path
                assert KEY.encode() not in body
                wrong = {"Authorization": "Bearer nope"}
                assert (await get(s, f.proxy.url + path, headers=wrong))[0] == 401
                assert (await get(s, f.proxy.url + path, headers=bearer))[0] == 200
            # The page itself holds no data: it loads, then asks for the key.
            assert (await get(s, f.proxy.url + "/dashboard"))[0] == 200
        async with fleet(n_prefill=1, n_decode=1, proxy=keys) as f:
            for path in ("/metrics", "/dashboard/data"):
                assert (await get(s, f.proxy.url + path))[0] == 200, path


@pytest.mark.parametrize(
    ("argv", "environ", "on"),
    [
        ([], {}, True),
        (["--no-dashboard"], {}, False),
        ([], {"PDPROXY_NO_DASHBOARD": "1"}, False),
        ([], {"PDPROXY_NO_DASHBOARD": "0"}, True),
    ],
)
def test_no_dashboard_flag_and_env(argv, environ, on):
    engines = ["--prefill", "127.0.0.1:8100", "--decode", "127.0.0.1:8200"]
    assert parse_config([*engines, *argv], environ).dashboard is on


async def test_kv_events_rows_come_from_status(tmp_path):
    """Per engine rank: followed, indexed blocks, the self-check's figures and whether it
    is stale, as ``/status`` says them (the page's KV-events table renders these)."""
    from pdproxy.scheduling.kv_keys import instance_name
    from tests.faults.test_kv_events import generate, kv_fleet, prompt

    async with kv_fleet(tmp_path) as f, aiohttp.ClientSession() as s:
        await generate(f, prompt(0))
        index = f.state.kv_events.index
        for _ in range(300):  # its events teach the block size: decodes are checked after
            if index.block_size:
                break
            await asyncio.sleep(0.01)
        await generate(f, prompt(1))
        decodes = {instance_name(d.url, 0) for d in f.decodes}

        def checked(d: dict) -> bool:  # a prefill's answer and a decode's own stores
            ranks = d["kv_events"]["instances"]
            return {n in decodes for n, r in ranks.items() if r["self_check"]} == {True, False}

        agreed: list[bool] = []  # each answer's blocks against the index's, when it came

        def settled(d: dict) -> bool:  # and the last request's stores have all arrived
            held = f.state.kv_events.index.held
            ranks = d["kv_events"]["instances"]
            agreed.append(all(r["indexed_blocks"] == held(n) for n, r in ranks.items()))
            return checked(d) and agreed[-1]

        kv = (await eventually(s, f.proxy.url, settled, timeout=5))["kv_events"]
        assert agreed[-1], kv  # the rows say what the index holds
        async with s.get(f.proxy.url + "/status") as r:
            status = (await r.json())["kv_events"]
        assert set(kv["instances"]) == set(status["instances"])
        assert len(kv["instances"]) == 4  # two prefills and two decodes, one rank each
        for rank in kv["instances"].values():
            assert rank["followed"] is True and rank["stale"] is False and rank["live"] is True
        # Ranks hold blocks from their events and have their predictions checked: a
        # prefill's against its answer (vLLM reports the prefill's hit), a decode's against
        # the first block it stored (kv_awaited; the very first request is not, its block
        # size was not known yet).
        assert checked({"kv_events": kv}), kv
        held = [r for r in kv["instances"].values() if r["indexed_blocks"]]
        assert len(held) >= 2
        assert sum(r["indexed_blocks"] for r in kv["instances"].values()) >= kv["indexed_blocks"]


# A tenant name the tenants file accepts (printable ASCII, no space) that is markup.
HOSTILE = "<img/src=x/onerror=alert(1)>"


def flow_fleet():
    """One slot (``--max-concurrent-requests 1``) and tenants: ``batch`` at priority 10, the
    hostile name at weight 2, a tenant header; engines at 50 tokens/s."""
    tenants = TenantsConfig(
        tenants={"batch": TenantSpec(priority=10), HOSTILE: TenantSpec(weight=2)},
        header="x-tenant",
    )
    limits = AdmissionConfig(max_concurrent=1, max_queued=20, queue_timeout=10)
    proxy = {"admission": limits, "tenants": tenants}
    return fleet(n_prefill=1, n_decode=1, proxy=proxy, decode_tps=50)


async def complete(s: aiohttp.ClientSession, url: str, max_tokens: int, tenant: str | None = None):
    headers = {} if tenant is None else {"x-tenant": tenant}
    # streamed: the holder's tokens keep coming, within the fleet's 2 s read timeout
    body = {"model": MODEL, "prompt": "who waits", "max_tokens": max_tokens, "stream": True}
    async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
        await r.read()
        return r.status


async def hold_the_slot_and_queue(
    f, s: aiohttp.ClientSession, hold_tokens: int = 100
) -> list[asyncio.Task]:
    """A default request holding the one slot for ``hold_tokens`` at 50 tokens/s (2 s), and
    queued behind it two of ``batch`` and one of the hostile tenant."""
    url, admission = f.proxy.url, f.state.admission
    tasks = [asyncio.create_task(complete(s, url, hold_tokens))]
    await wait_until(lambda: admission.active == 1, timeout=5, what="the slot taken")
    for tenant in ("batch", "batch", HOSTILE):
        tasks.append(asyncio.create_task(complete(s, url, 2, tenant)))
    await wait_until(lambda: admission.queued == 3, timeout=5, what="three requests queued")
    return tasks


async def test_flow_is_status_flow_with_who_waits_and_each_tenant():
    """While one request holds the only slot and three wait: ``flow`` is ``/status``'s
    section, a row per (stage, priority, tenant) that waits; once all are served, each
    tenant's admissions, nothing in flight or waiting, no prediction checked."""
    async with flow_fleet() as f, aiohttp.ClientSession() as s:
        tasks = await hold_the_slot_and_queue(f, s)
        d = await data(s, f.proxy.url)
        async with s.get(f.proxy.url + "/status") as r:
            status = (await r.json())["flow"]

        flow = d["flow"]
        assert flow == status
        assert set(flow) == {"tenants_file", "queued", "waiting", "tenants", "prediction"}
        assert flow["tenants_file"] is None and flow["queued"] == 3
        assert flow["waiting"] == [
            {"stage": "admission", "priority": 0, "tenant": HOSTILE, "waiting": 1},
            {"stage": "admission", "priority": 10, "tenant": "batch", "waiting": 2},
        ]
        assert flow["tenants"]["default"]["in_flight"] == 1  # the one holding the slot

        assert await asyncio.gather(*tasks) == [200] * 4
        d = await eventually(
            s, f.proxy.url, lambda d: d["flow"]["tenants"]["batch"]["in_flight"] == 0, timeout=3
        )
        flow = d["flow"]
        assert flow["queued"] == 0 and flow["waiting"] == []
        assert set(flow["tenants"]) == {"batch", "default", HOSTILE}
        assert flow["tenants"]["batch"] == {
            "weight": 1.0,
            "priority": 10,
            "in_flight": 0,
            "admitted": 2,
            "refused": {},
            "slo_met": 0,
            "slo_missed": 0,
        }
        hostile = flow["tenants"][HOSTILE]
        assert hostile["weight"] == 2.0 and hostile["admitted"] == 1
        assert flow["tenants"]["default"]["admitted"] == 1
        assert flow["prediction"] == {"samples": 0, "median_error_ms": None}
