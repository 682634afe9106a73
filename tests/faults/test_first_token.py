"""The fault matrix with ``--first-token-from-prefill``: once the prefill's token reached the
client, a decode that refuses, hangs, answers 5xx or dies mid-stream is a mid-stream failure:
the stream migrates to another decode when there is one (``--migration-limit``) and ends in
its one error event after t1 when there is none (never an empty 200); a client that leaves
is let go, and everything settles (``harness.assert_settled``)."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from tests.faults.harness import GENERATE, all_ok, assert_settled, body, drive, fleet

pytestmark = pytest.mark.faults

ON = {"first_token_from_prefill": True}
# The harness's prompts are 14-15 tokens, one sim block of 16: bound the block size first.
LEARN = [list(range(1, 33)), list(range(1, 34))]


async def _learn(f) -> None:
    async with aiohttp.ClientSession() as session:
        for ids in LEARN:
            payload = {**body(0, stream=True, chat=False, generate=True), "token_ids": ids}
            async with session.post(f.proxy.url + GENERATE, json=payload) as r:
                assert r.status == 200, await r.read()
                await r.read()


def _first_is_t1(raw: bytes) -> None:
    first = orjson.loads(raw.split(b"\n\n")[0][6:])
    assert len(first["choices"][0]["token_ids"]) == 1, first


@pytest.mark.parametrize(
    "fault",
    [
        {"refuse_connections": True},
        {"status": 503},
        {"hang": True},
        {"close_after_tokens": 2},
        {"fail_kv_load": True},
    ],
    ids=["refuses", "5xx", "hangs", "dies_mid_stream", "kv_load_fails"],
)
async def test_a_decode_failing_after_t1_ends_the_stream_with_one_error_event(fault):
    """The only decode fails after t1: no other decode to migrate to (the failed one is
    never chosen again for the stream), so the error event."""
    async with fleet(n_prefill=1, n_decode=1, proxy=ON) as f:
        await _learn(f)
        f.decodes[0].set_faults(**fault)
        outcomes = await drive(f, 4, stream=True, generate=True)
        for outcome in outcomes:
            assert outcome.status == 200, outcome.body[-300:]
            _first_is_t1(outcome.body)
        # (a refused listener still leaves the pool's open connection: that one answers)
        assert sum(o.error is not None for o in outcomes) >= 3, [o.body for o in outcomes]
        f.decodes[0].set_faults()
        await assert_settled(f)


async def test_healthy_fleet_streams_with_t1_and_settles():
    async with fleet(proxy=ON) as f:
        await _learn(f)
        all_ok(await drive(f, 8, stream=True, generate=True))
        await assert_settled(f)


async def test_client_leaves_after_t1():
    async with fleet(n_prefill=1, n_decode=1, proxy=ON, decode_tps=50) as f:
        await _learn(f)
        async with aiohttp.ClientSession() as session:
            resp = await session.post(
                f.proxy.url + GENERATE,
                json=body(0, stream=True, chat=False, max_tokens=200, generate=True),
            )
            first = await resp.content.readuntil(b"\n\n")
            resp.close()
        _first_is_t1(first)
        await assert_settled(f)


async def test_client_leaves_while_the_decode_is_silent():
    async with fleet(n_prefill=1, n_decode=1, proxy=ON) as f:
        await _learn(f)
        f.decodes[0].set_faults(headers_delay_s=0.5)
        async with aiohttp.ClientSession() as session:
            resp = await session.post(
                f.proxy.url + GENERATE,
                json=body(0, stream=True, chat=False, max_tokens=20, generate=True),
            )
            first = await resp.content.readuntil(b"\n\n")
            resp.close()
        _first_is_t1(first)
        f.decodes[0].set_faults()
        await assert_settled(f)


def _token_ids(raw: bytes) -> list[int]:
    events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: {")]
    return [t for e in map(orjson.loads, events) for c in e["choices"] for t in c["token_ids"]]


async def test_a_decode_dying_after_t1_migrates_to_the_other_decode_exactly():
    """Two decodes, one cutting its streams after 2 tokens: every stream that started with
    the prefill's token completes on the other decode with the uninterrupted token ids."""
    async with fleet(n_prefill=1, n_decode=2, proxy=ON) as f:
        await _learn(f)
        healthy = await drive(f, 6, stream=True, generate=True, max_tokens=12)
        all_ok(healthy)
        f.decodes[0].set_faults(close_after_tokens=2)
        cut = await drive(f, 6, stream=True, generate=True, max_tokens=12)
        all_ok(cut)
        for before, after in zip(healthy, cut, strict=True):
            _first_is_t1(after.body)
            assert _token_ids(after.body) == _token_ids(before.body)
            assert len(_token_ids(after.body)) == 12
        migrated = f.proxy.state.metrics.registry.get_sample_value(
            "pdproxy_migrations_total", {"reason": "reset", "outcome": "migrated"}
        )
        assert migrated is not None and migrated >= 1
        f.decodes[0].set_faults()
        await assert_settled(f)
