"""A hostile engine's KV-event publisher (``--prefill-policy kv-events``): batches at the
bound on a batch's size, made of the most blocks a byte can carry, into a full index, and
batches over the bound. pdproxy applies each batch in turns of ``_TURN_BLOCKS`` blocks
(before, a batch of 180,000 blocks held the loop for a second, and a store into a full index
cost 35-80 us a block): /health stays fast, every client gets its own answer, the index
stays within its cap and memory bounded. Batches that cannot be applied or decoded are
counted and logged at a limited rate (before issue 29: a traceback each)."""

from __future__ import annotations

import asyncio
import json
import sys

import aiohttp

from engines.ports import free_port
from tests.hostile.test_clients import (
    HealthProbe,
    MiB,
    completions,
    health_probed,
    own_answers,
    pdproxy,
)

MAX_BLOCKS = 50_000  # filled by the first batch: every later block evicts one
# The index at its cap (two roles, 100 bytes a block, and each rank's 50,000 engine hashes)
# and a batch in flight on each of the two subscribers (180,000 blocks decode to about
# 10 MB of Python objects) A publisher faster than pdproxy grows it no
# further (the subscriber's queue holds 64 batches); before the bound on a batch, one
# 64 MB batch alone decoded to several hundred MB.
RSS_BUDGET = 192 * MiB
FLOOD_S = 5.0


async def _status(url: str) -> dict:
    async with aiohttp.ClientSession() as s, s.get(url + "/status") as r:
        return (await r.json())["kv_events"]


def _flags(port: int, max_blocks: int) -> tuple[str, ...]:
    return (
        *("--prefill-policy", "kv-events", "--decode-policy", "kv-events"),
        *("--kv-events-endpoint", f"tcp://127.0.0.1:{port}"),
        *("--prefix-index-max-blocks", str(max_blocks)),
    )


async def _flooded(proxy, port: int, *mode: str) -> tuple[dict, HealthProbe]:
    """Run ``tests.hostile.kv_flood`` (``mode``) against ``proxy`` while clients check
    their own answers and /health is probed; returns what it sent and the probe."""
    reference = await completions(proxy, range(8))
    args = [sys.executable, "-m", "tests.hostile.kv_flood", str(port), str(FLOOD_S), *mode]
    flood = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE)
    sent: dict = {}
    try:
        assert flood.stdout is not None
        assert await asyncio.wait_for(flood.stdout.readline(), 15) == b"ready\n"
        with health_probed(proxy) as probe:
            while flood.returncode is None and not flood.stdout.at_eof():
                await own_answers(proxy, range(8), reference)
                try:
                    line = await asyncio.wait_for(flood.stdout.readline(), 0.2)
                except TimeoutError:
                    continue
                if line:
                    sent = json.loads(line)
                    break
        assert await asyncio.wait_for(flood.wait(), 10) == 0
    finally:
        if flood.returncode is None:
            flood.kill()
            await flood.wait()
    return sent, probe


async def test_a_flood_of_batches_at_the_bound_into_a_full_index_never_stalls_pdproxy(tmp_path):
    port = free_port()
    async with pdproxy(tmp_path, *_flags(port, MAX_BLOCKS)) as proxy:
        quiet_rss = proxy.rss()
        sent, probe = await _flooded(proxy, port)
        status = await _status(proxy.url)
    assert sent["under"] >= 3 and sent["over"] >= 1, sent
    assert probe.max_rss - quiet_rss < RSS_BUDGET, (quiet_rss, probe.max_rss)
    # both legs subscribed (one endpoint for both engines here) and took whole batches
    ranks = status["instances"].values()
    assert len(ranks) == 2 and all(r["batches"] >= 1 for r in ranks), status
    assert all(r["indexed_blocks"] <= MAX_BLOCKS for r in ranks), status
    assert status["indexed_blocks"] <= status["max_blocks"] == MAX_BLOCKS, status


async def test_batches_of_clears_into_a_full_index_never_stall_pdproxy(tmp_path):
    # Issue 29: AllBlocksCleared walked the whole prefix index (about 2.5 us an entry) and
    # the batch splitter did not count it as work: with a full index one 414-byte batch of
    # 10 clears froze /health for 15 s. A clear now takes out what that engine held, in
    # turns of 1,024 keys.
    port = free_port()
    async with pdproxy(tmp_path, *_flags(port, 4 * MAX_BLOCKS)) as proxy:
        sent, _ = await _flooded(proxy, port, "clears")
        status = await _status(proxy.url)
    assert sent["clears"] >= 3, sent
    ranks = status["instances"].values()
    assert len(ranks) == 2 and all(r["batches"] >= sent["clears"] for r in ranks), status


async def test_a_flood_of_malformed_batches_is_counted_and_logged_at_a_limited_rate(tmp_path):
    # Issue 29: each bad batch logged a whole traceback, unlimited (5,000 batches of 39
    # bytes: 5 MB of log). They are counted, and logged at most once per 10 s per kind,
    # without tracebacks.
    port = free_port()
    async with pdproxy(tmp_path, *_flags(port, MAX_BLOCKS)) as proxy:
        sent, _ = await _flooded(proxy, port, "garbage")
        status = await _status(proxy.url)
        log = proxy.log().splitlines()
    lines = [x for x in log if "Traceback" in x or " pdproxy.membership." in x]
    malformed = sum(r["malformed"] for r in status["instances"].values())
    assert sent["garbage"] >= 5000 and malformed >= 1000, (sent, status)
    assert not any("Traceback" in line for line in lines), lines[:5]
    # once per 10 s per kind (not applied, undecodable) and per subscriber (two)
    bad = [line for line in lines if " WARNING " in line or " ERROR " in line]
    assert len(bad) <= 4, bad
