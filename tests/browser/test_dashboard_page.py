"""The live dashboard in a real headless Chromium, in front of a 2P2D sim fleet.

The page must show the four instances and live request figures, show a killed decode as
down within a bounded time, fetch nothing from any origin but pdproxy's, weigh under
200 KB, and run without a script error. With flow control on, the queue panel shows who
waits and each tenant's figures, with markup in a tenant's name shown as text. Screenshots
land in the test's tmp_path (printed).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from urllib.parse import urlsplit

import aiohttp
import pytest

from tests.faults.harness import all_ok, drive, fleet

pytestmark = pytest.mark.browser

PAGE_BUDGET = 200 * 1024  # bytes: HTML, CSS and JS together
SHOWS_DOWN_WITHIN_S = 10.0  # health checks every 0.25 s, the page polls every 1 s
LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
NUMBER = re.compile(r"^\d+(\.\d+)?$")


class Watch:
    """What the page did: requests outside loopback (blocked), script errors, bytes."""

    def __init__(self) -> None:
        self.blocked: list[str] = []
        self.errors: list[str] = []
        self.asset_bytes: dict[str, int] = {}

    async def route(self, route) -> None:
        url = route.request.url
        if urlsplit(url).hostname in LOOPBACK:
            await route.continue_()
        else:
            self.blocked.append(url)
            await route.abort()

    def console(self, message) -> None:
        if message.type == "error":
            self.errors.append(message.text)

    async def response(self, response) -> None:
        path = urlsplit(response.url).path
        if path.startswith("/dashboard") and path != "/dashboard/data":
            self.asset_bytes[path] = len(await response.body())


async def text(page, selector: str) -> str:
    return (await page.text_content(selector) or "").strip()


async def window(proxy_url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(proxy_url + "/dashboard/data") as r:
        return (await r.json())["window"]


async def test_dashboard_shows_the_fleet_live(chromium, tmp_path):
    from playwright.async_api import async_playwright

    async with fleet() as f, async_playwright() as pw:
        all_ok(await drive(f, 16))
        browser = await pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            context = await browser.new_context(viewport={"width": 1440, "height": 900})
            watch = Watch()
            await context.route("**/*", watch.route)
            page = await context.new_page()
            page.on("console", watch.console)
            page.on("pageerror", lambda exc: watch.errors.append(str(exc)))
            page.on("response", watch.response)

            await page.goto(f.proxy.url + "/dashboard")

            # Every instance, under its role, up.
            await page.wait_for_selector('[data-rows] tr[data-status="up"] >> nth=3')
            for role, sims in (("prefill", f.prefills), ("decode", f.decodes)):
                rows = page.locator(f'[data-rows="{role}"] tr[data-url]')
                assert sorted(await rows.evaluate_all("rs => rs.map(r => r.dataset.url)")) == (
                    sorted(s.url for s in sims)
                )
            assert await text(page, "#readiness") == "ready"
            assert "live" in await text(page, "#live-text")
            assert await page.is_hidden("[data-flow]")  # flow control off: no queue panel

            # Live figures: the requests made before the page opened, with their unit.
            rate = await text(page, '[data-kpi="rate"]')
            assert NUMBER.match(rate) and float(rate) > 0, rate
            assert "16 requests" in await text(page, '[data-note="rate"]')
            assert await text(page, '[data-kpi="errors"]') == "0"
            await _check_ttft(page, f.proxy.url)

            # Steady traffic while it is open: the figures move without a reload, and the
            # sparklines fill in (a point per 2 s).
            trickle = asyncio.create_task(_trickle(f))
            await page.wait_for_function(
                """() => parseInt(document.querySelector('[data-note="rate"]').textContent) > 16""",
                timeout=5000,
            )
            await page.wait_for_function(
                """() => document.querySelector('[data-spark="rate"]').dataset.points >= 3""",
                timeout=10_000,
            )
            await page.screenshot(path=tmp_path / "dashboard.png", full_page=True)

            # A decode dies: its row turns down within the bound, the others stay up.
            victim = f.decodes[0]
            await victim.kill()
            started = time.monotonic()
            await page.wait_for_selector(
                f'tr[data-url="{victim.url}"][data-status="down"]',
                timeout=SHOWS_DOWN_WITHIN_S * 1000,
            )
            shown_after = time.monotonic() - started
            health = await text(page, f'tr[data-url="{victim.url}"] [data-field="health"]')
            assert health.startswith("unhealthy"), health
            assert await page.locator('tr[data-status="up"]').count() == 3
            assert "1 up" in await text(page, '[data-summary="decode"]')
            await asyncio.sleep(2)  # a sparkline point after the kill
            await page.screenshot(path=tmp_path / "dashboard-decode-down.png", full_page=True)
            trickle.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await trickle

            # The same page, dark.
            await page.emulate_media(color_scheme="dark")
            await page.screenshot(path=tmp_path / "dashboard-dark.png", full_page=True)
            print(f"\ndashboard screenshots in {tmp_path} (down shown after {shown_after:.1f} s)")

            assert not watch.blocked, watch.blocked
            assert not watch.errors, watch.errors
            assert set(watch.asset_bytes) == {
                "/dashboard",
                "/dashboard/dashboard.css",
                "/dashboard/dashboard.js",
                "/dashboard/dom.js",
                "/dashboard/kv_events.js",
                "/dashboard/flow.js",
            }
            assert sum(watch.asset_bytes.values()) < PAGE_BUDGET, watch.asset_bytes
        finally:
            await browser.close()


async def test_dashboard_shows_each_engine_ranks_kv_events(chromium, tmp_path):
    """A kv-events fleet: a row per engine rank (followed, indexed blocks, the self-check's
    figures); a prefill whose events stop while it is sent work gets the ``stale`` badge,
    and loses it when they flow again. Without events the table stays hidden (above)."""
    from playwright.async_api import async_playwright

    from engines.sim import model
    from tests.faults.harness import wait_until
    from tests.faults.test_kv_events import generate, kv_fleet, predicted, prompt

    TENANT = model.tokenize(" ".join(f"tenant{i}" for i in range(128)))
    async with kv_fleet(tmp_path, stale_secs=0.5) as f, async_playwright() as pw:
        p, other = f.prefills
        f.instance(other).legs.work = 100.0  # every request on p
        await generate(f, prompt(0))
        # p's batch heard before the next pick, or its prediction is none, and unchecked
        await wait_until(lambda: predicted(f, p, prompt(1)) > 0, timeout=3, what="p's events")
        await generate(f, prompt(1))  # a checked prediction
        browser = await pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = await browser.new_page(viewport={"width": 1440, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(f.proxy.url + "/dashboard")
            row = f'tr[data-rank="{p.url}|0"]'
            await page.wait_for_selector(f'{row}[data-badge="events"]')
            assert await page.locator("[data-kv-rows] tr[data-rank]").count() == 4
            assert await text(page, f'{row} [data-field="followed"]') == "yes"
            assert int(await text(page, f'{row} [data-field="indexed_blocks"]')) > 0
            assert await text(page, f'{row} [data-field="checked"]') == "1"
            assert await text(page, f'{row} [data-field="wrong"]') == "0"
            assert await text(page, f'{row} [data-field="error"]') == "0"
            assert "blocks indexed" in await text(page, '[data-summary="kv_events"]')

            p.kv_events.faults.stopped = True
            await generate(f, prompt(2))  # its own tail's block, unheard
            await asyncio.sleep(0.5)
            await generate(f, prompt(3))  # its decision finds p stale
            await page.wait_for_selector(f'{row}[data-badge="stale"]', timeout=5000)
            await page.screenshot(path=tmp_path / "dashboard-kv-stale.png", full_page=True)
            p.kv_events.faults.stopped = False
            await generate(f, prompt(4, TENANT))  # stored and heard
            await page.wait_for_selector(f'{row}[data-badge="events"]', timeout=5000)
            assert not errors, errors
            print(f"\nKV-events screenshot in {tmp_path}")
        finally:
            await browser.close()
            f.instance(other).legs.work = 0.0


# /status's flow section as the queue panel gets it, names that are markup among them: the
# brief's example and the shape FlowBook.status() answers.
FAKE_FLOW = {
    "tenants_file": "/etc/pdproxy/<b>tenants</b>.yaml",
    "queued": 12,
    "waiting": [
        {"stage": "admission", "priority": 0, "tenant": "interactive", "waiting": 3},
        {"stage": "prefill", "priority": 10, "tenant": "batch", "waiting": 9},
        {"stage": "decode", "priority": -5, "tenant": "<img src=x onerror=alert(1)>", "waiting": 1},
    ],
    "tenants": {
        "batch": {
            "weight": 1.0,
            "priority": 10,
            "in_flight": 4,
            "admitted": 120,
            "refused": {"rate_limit": 3, "deadline": 0},
            "slo_met": 0,
            "slo_missed": 0,
        },
        "interactive": {
            "weight": 3.0,
            "priority": 0,
            "in_flight": 2,
            "admitted": 1234,
            "refused": {"deadline": 1, "queue_timeout": 2},
            "slo_met": 39,
            "slo_missed": 1,
        },
        "<img src=x onerror=alert(1)>": {
            "weight": 0.5,
            "priority": -5,
            "in_flight": 1,
            "admitted": 7,
            "refused": {"<script>alert(2)</script>": 1},
            "slo_met": 1999,
            "slo_missed": 1,
        },
        "__proto__": {
            "weight": 1.0,
            "priority": 0,
            "in_flight": 0,
            "admitted": 0,
            "refused": {},
            "slo_met": 5,
            "slo_missed": 0,
        },
    },
    "prediction": {"samples": 40, "median_error_ms": 35.0},
}


async def rows(page, body: str) -> list[list[str]]:
    """The text of every cell of ``body``'s rows."""
    return await page.locator(f"{body} tr").evaluate_all(
        "rs => rs.map(r => [...r.cells].map(c => c.textContent.trim()))"
    )


async def test_dashboard_shows_the_queue_panel(chromium, tmp_path):
    """Flow control on, one slot: three requests queued behind the one served show in the
    waiting table (the hostile tenant's name as text), each tenant's admissions once served;
    then a fake ``flow`` in the page's data (route) gives every figure of the panel exactly,
    markup in names and reasons as text; ``flow: null`` hides the panel."""
    from playwright.async_api import async_playwright

    from tests.integration.test_dashboard import HOSTILE, flow_fleet, hold_the_slot_and_queue

    async with flow_fleet() as f, async_playwright() as pw, aiohttp.ClientSession() as s:
        browser = await pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = await browser.new_page(viewport={"width": 1440, "height": 900})
            errors: list[str] = []
            dialogs: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("dialog", lambda d: dialogs.append(d.message))
            await page.goto(f.proxy.url + "/dashboard")
            await page.wait_for_selector("[data-flow]:not([hidden])")
            assert await rows(page, "[data-flow-waiting]") == [["nobody waits"]]

            # Live: who waits behind the one slot (held 4 s), then each tenant's admissions.
            tasks = await hold_the_slot_and_queue(f, s, hold_tokens=200)
            await page.wait_for_selector('[data-flow-waiting] tr[data-tenant="batch"]')
            assert await rows(page, "[data-flow-waiting]") == [
                ["admission", "0", HOSTILE, "1"],
                ["admission", "10", "batch", "2"],
            ]
            assert "3 waiting" in await text(page, '[data-summary="flow"]')
            await page.screenshot(path=tmp_path / "dashboard-queue.png", full_page=True)
            assert await asyncio.gather(*tasks) == [200] * 4
            await page.wait_for_function(
                """() => document.querySelector('[data-summary="flow"]').textContent
                    .startsWith('0 waiting')"""
            )
            await page.wait_for_function(
                """() => [...document.querySelectorAll('[data-flow-tenants] tr')]
                    .every(r => r.cells[3].textContent === '0')"""
            )
            assert await rows(page, "[data-flow-tenants]") == [
                [HOSTILE, "2", "0", "0", "1", "0", "—"],
                ["batch", "1", "10", "0", "2", "0", "—"],
                ["default", "1", "0", "0", "1", "0", "—"],
            ]
            assert "none checked yet" in await text(page, "[data-flow-prediction]")

            # Every figure from a known section, through the page's own poll.
            async def fake(flow, route):
                response = await route.fetch()
                body = await response.json()
                await route.fulfill(response=response, json={**body, "flow": flow})

            await page.route("**/dashboard/data", lambda route: fake(FAKE_FLOW, route))
            await page.wait_for_selector('[data-flow-waiting] tr[data-stage="decode"]')
            hostile = "<img src=x onerror=alert(1)>"
            assert await rows(page, "[data-flow-waiting]") == [
                ["admission", "0", "interactive", "3"],
                ["prefill", "10", "batch", "9"],
                ["decode", "-5", hostile, "1"],
            ]
            assert await rows(page, "[data-flow-tenants]") == [
                [hostile, "0.5", "-5", "1", "7", "<script>alert(2)</script> 1", "99.9 % of 2,000"],
                ["__proto__", "1", "0", "0", "0", "0", "100 % of 5"],
                ["batch", "1", "10", "4", "120", "rate_limit 3", "—"],
                [
                    "interactive",
                    "3",
                    "0",
                    "2",
                    "1,234",
                    "queue_timeout 2, deadline 1",
                    "97.5 % of 40",
                ],
            ]
            assert await text(page, '[data-summary="flow"]') == (
                "12 waiting · 4 tenants · tenants file /etc/pdproxy/<b>tenants</b>.yaml"
            )
            assert await text(page, "[data-flow-prediction]") == (
                "TTFT prediction: median error 35 ms · 40 predictions checked"
            )
            # markup stayed text: no element was made of it, nothing ran
            assert (
                await page.locator("[data-flow] img, [data-flow] script, [data-flow] b").count()
                == 0
            )
            await page.screenshot(path=tmp_path / "dashboard-queue-fake.png", full_page=True)

            await page.unroute("**/dashboard/data")
            await page.route("**/dashboard/data", lambda route: fake(None, route))
            await page.wait_for_selector("[data-flow]", state="hidden")
            assert not errors, errors
            assert not dialogs, dialogs
            print(f"\nqueue panel screenshots in {tmp_path}")
        finally:
            await browser.close()


async def _trickle(f) -> None:
    """Two requests at a time, about four a second, until cancelled."""
    for i in range(1000, 100_000, 2):
        await drive(f, 2, concurrency=2, start=i)
        await asyncio.sleep(0.25)


async def _check_ttft(page, proxy_url: str) -> None:
    """TTFT shows with its unit whenever pdproxy's histogram has first bytes in the window."""
    figures = await window(proxy_url)
    p50 = await text(page, '[data-kpi="p50"]')
    if figures["ttft_p50_seconds"] is None:
        assert p50 == "—"
    else:
        await page.wait_for_function(
            """() => document.querySelector('[data-kpi="p50"]').textContent !== '—'"""
        )
        p50 = await text(page, '[data-kpi="p50"]')
        assert NUMBER.match(p50), p50
        assert await text(page, '[data-unit="p50"]') in ("ms", "s")


async def test_page_asks_for_the_key_when_metrics_are_protected(chromium, tmp_path):
    from playwright.async_api import async_playwright

    key = "browser-test-key"
    proxy = {"api_keys": (key,), "protect_metrics": True}
    async with fleet(n_prefill=1, n_decode=1, proxy=proxy) as f, async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        try:
            page = await browser.new_page()
            await page.goto(f.proxy.url + "/dashboard")
            await page.wait_for_selector("#keyform:not([hidden])")
            assert await page.locator("tr[data-url]").count() == 0
            await page.screenshot(path=tmp_path / "dashboard-key-prompt.png")
            await page.fill("#key", key)
            await page.click("#keyform button")
            await page.wait_for_selector('tr[data-status="up"] >> nth=1')
            assert await page.is_hidden("#keyform")
            await page.screenshot(path=tmp_path / "dashboard-with-key.png")
        finally:
            await browser.close()
