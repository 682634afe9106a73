"""Mid-stream migration (issue 20): a decode cut, killed, hung or drained mid-stream, and the
client's stream still completes with the uninterrupted answer (the sim's decode is
autoregressive, so a continuation from prompt + first k tokens is exact on every path)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from typing import Any

import aiohttp
import orjson
import pytest

from pdproxy.observability.log import ACCESS_LOGGER
from pdproxy.proxying.migration import Migrations
from tests.faults.harness import (
    GENERATE,
    RETRY,
    Fleet,
    assert_settled,
    body,
    fleet,
    wait_until,
)
from tests.integration.conftest import ROUND_ROBIN

pytestmark = pytest.mark.faults

TOKENS = 12


@dataclasses.dataclass
class Stream:
    """A streamed answer as the client saw it."""

    events: list[dict[str, Any]]
    done: bool

    @property
    def error(self) -> str | None:
        errors = [e["error"]["type"] for e in self.events if "error" in e]
        return errors[0] if errors else None

    @property
    def content(self) -> list[Any]:
        """The generated pieces, in order (text, delta content or token ids)."""
        pieces: list[Any] = []
        for event in self.events:
            for choice in event.get("choices") or ():
                if "token_ids" in choice and "text" not in choice and "delta" not in choice:
                    pieces.extend(choice["token_ids"])
                elif "delta" in choice:
                    if choice["delta"].get("content"):
                        pieces.append(choice["delta"]["content"])
                elif choice.get("text"):
                    pieces.append(choice["text"])
        return pieces

    def field(self, name: str) -> set[Any]:
        return {e[name] for e in self.events if name in e and "error" not in e}

    @property
    def roles(self) -> int:
        return sum(
            1 for e in self.events for c in e.get("choices") or () if "role" in c.get("delta", {})
        )

    @property
    def finish(self) -> Any:
        reasons = [c["finish_reason"] for e in self.events for c in e.get("choices") or ()]
        return [r for r in reasons if r is not None]

    @property
    def usage(self) -> dict[str, Any] | None:
        usages = [e["usage"] for e in self.events if e.get("usage")]
        return usages[-1] if usages else None


def payload(i: int, kind: str, *, usage: bool = False, **extra: Any) -> dict[str, Any]:
    data = body(i, stream=True, chat=kind == "chat", generate=kind == "generate", max_tokens=TOKENS)
    if usage:
        data["stream_options"] = {"include_usage": True}
    data.update(extra)
    return data


async def stream(session: aiohttp.ClientSession, url: str, kind: str, data: dict) -> Stream:
    path = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}.get(kind, GENERATE)
    async with session.post(url + path, json=data) as r:
        assert r.status == 200, await r.read()
        raw = await r.read()
    assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
    events = [e[6:] for e in raw.split(b"\n\n") if e.startswith(b"data: ")]
    return Stream([orjson.loads(e) for e in events[:-1]], True)


async def answers(
    f: Fleet, kind: str, n: int, *, usage: bool = False, **extra: Any
) -> list[Stream]:
    async with aiohttp.ClientSession() as session:
        return list(
            await asyncio.wait_for(
                asyncio.gather(
                    *(
                        stream(session, f.proxy.url, kind, payload(i, kind, usage=usage, **extra))
                        for i in range(n)
                    )
                ),
                8.0,
            )
        )


def assert_same(got: list[Stream], want: list[Stream], kind: str, usage: bool) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.error is None, g.events[-1]
        assert g.content == w.content  # no repeated, no missing token
        assert len(g.content) == TOKENS
        assert g.finish == ["length"]
        for name in ("id", "request_id", "created", "model"):
            assert len(g.field(name)) <= 1, (name, g.field(name))
        if kind == "chat":
            assert g.roles == 1
        if usage:  # the cache figures are the continuation's own
            keys = ("prompt_tokens", "completion_tokens", "total_tokens")
            assert {k: g.usage[k] for k in keys} == {k: w.usage[k] for k in keys}
        else:
            assert g.usage is None


def migrated(f: Fleet, reason: str = "reset") -> float:
    return f.metric("pdproxy_migrations_total", reason=reason, outcome="migrated")


@pytest.mark.parametrize("kind", ["completions", "chat", "generate"])
@pytest.mark.parametrize("usage", [False, True])
@pytest.mark.parametrize("k", [1, 5, "random"])
async def test_a_decode_cut_after_k_tokens_migrates_and_the_stream_is_whole(kind, usage, k):
    cut = random.randint(1, TOKENS - 1) if k == "random" else k
    async with fleet() as f:
        want = await answers(f, kind, 4, usage=usage)
        f.decodes[0].set_faults(close_after_tokens=cut)
        got = await answers(f, kind, 4, usage=usage)
        assert_same(got, want, kind, usage)
        assert migrated(f) >= 1
        await assert_settled(f)


async def test_a_decode_hung_mid_stream_migrates_when_the_watchdog_fires():
    async with fleet() as f:
        want = await answers(f, "completions", 2)
        f.decodes[0].set_faults(hang_after_tokens=3)
        got = await answers(f, "completions", 2)
        assert_same(got, want, "completions", False)
        assert migrated(f, "timeout") >= 1
        await assert_settled(f)


async def test_past_the_migration_limit_the_stream_ends_with_the_error_event():
    retry = dataclasses.replace(RETRY, migration_limit=1)
    async with fleet(n_decode=3, proxy={"retry": retry}) as f:
        for d in f.decodes:
            d.set_faults(close_after_tokens=3)
        got = await answers(f, "completions", 2)
        assert all(g.error == "BadGatewayError" for g in got)
        assert all(len(g.content) == 6 for g in got)  # 3 + 3 after one migration
        assert f.metric("pdproxy_migrations_total", reason="reset", outcome="limit") == 2
        await assert_settled(f)


async def test_no_migration_with_limit_0_or_for_a_request_that_cannot_continue_exactly():
    async with fleet(proxy={"retry": dataclasses.replace(RETRY, migration_limit=0)}) as f:
        f.decodes[0].set_faults(close_after_tokens=2)
        got = await answers(f, "completions", 4)
        assert any(g.error == "BadGatewayError" for g in got)
        assert migrated(f) == 0
        await assert_settled(f)
    async with fleet() as f:
        f.decodes[0].set_faults(close_after_tokens=2)
        got = await answers(f, "completions", 4, logprobs=1)
        assert any(g.error == "BadGatewayError" for g in got)
        assert migrated(f) == 0
        await assert_settled(f)


async def test_a_client_that_leaves_during_a_migrated_stream_leaves_nothing_behind():
    async with fleet(decode_tps=50) as f:
        f.decodes[0].set_faults(close_after_tokens=2)
        async with aiohttp.ClientSession() as session:
            for i in range(4):
                data = payload(i, "completions", max_tokens=40)
                async with session.post(f.proxy.url + "/v1/completions", json=data) as r:
                    await r.content.readexactly(1)
                    await asyncio.sleep(0.1)
        await assert_settled(f)


async def test_a_non_streamed_request_whose_decode_dies_is_retried_whole():
    async with fleet() as f:
        f.decodes[0].set_faults(reset_after_bytes=5)
        async with aiohttp.ClientSession() as session:
            for i in range(4):
                data = payload(i, "completions", stream=False)
                async with session.post(f.proxy.url + "/v1/completions", json=data) as r:
                    assert r.status == 200
                    assert len((await r.json())["choices"][0]["text"].split()) == TOKENS
        await assert_settled(f)


@pytest.mark.parametrize("kind", ["completions", "chat"])
async def test_under_render_once_the_continuation_is_token_ids_and_the_stream_is_whole(kind):
    async with fleet(proxy={"render_once": True}) as f:
        want = await answers(f, kind, 4, usage=True)
        f.decodes[0].set_faults(close_after_tokens=4)
        got = await answers(f, kind, 4, usage=True)
        assert_same(got, want, kind, True)
        assert migrated(f) >= 1
        assert f.metric("pdproxy_render_once_requests_total", served="rendered") == 8
        await assert_settled(f)


async def test_a_drain_with_migrate_moves_the_open_streams_now_and_each_completes():
    async with fleet(decode_tps=25, proxy={"admin_api_key": "admin-key"}) as f:
        want = await answers(f, "chat", 4, usage=True)
        running = asyncio.ensure_future(answers(f, "chat", 4, usage=True))
        drained = f.decodes[0]
        await wait_until(
            lambda: f.instance(drained).legs.in_flight > 0, timeout=2, what="streams on it"
        )
        await asyncio.sleep(0.1)  # a few tokens each
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                f.proxy.url + "/instances/drain",
                json={"instance": drained.url.removeprefix("http://"), "migrate": True},
                headers={"X-API-Key": "admin-key"},
            ) as r,
        ):
            assert r.status == 200, await r.text()
            moved = (await r.json())["migrated_streams"]
        assert moved >= 1
        assert_same(await running, want, "chat", True)
        assert migrated(f, "drain") == moved
        # drained: no leg left on it, so it leaves the registry
        await wait_until(lambda: f.instance(drained) is None, timeout=5, what="drained")
        await assert_settled(f)


async def test_the_access_line_shows_each_migration(caplog):
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    async with fleet() as f:
        f.decodes[0].set_faults(close_after_tokens=3)
        await answers(f, "completions", 4)
        await assert_settled(f)
    hops = [m for r in caplog.records if (m := getattr(r, "fields", {}).get("migrations"))]
    assert hops and all(len(h) == 1 for h in hops)
    origin, _, to = hops[0][0].partition(" -> ")
    assert origin == f"{f.decodes[0].url} after 3 tokens (reset)"
    assert to.endswith(f.decodes[1].url)


async def test_a_long_stream_s_kept_bytes_are_folded_and_it_still_migrates_exactly(monkeypatch):
    folds = []
    fold = Migrations._fold
    monkeypatch.setattr(Migrations, "_fold", lambda *a: folds.append(1) or fold(*a))
    async with fleet() as f:
        long = {"max_tokens": 2400}
        want = await answers(f, "completions", 2, **long)
        f.decodes[0].set_faults(close_after_tokens=2000)  # past the 256 KiB fold
        got = await answers(f, "completions", 2, **long)
        for g, w in zip(got, want, strict=True):
            assert g.error is None and g.content == w.content and len(g.content) == 2400
        assert migrated(f) >= 1 and folds
        await assert_settled(f)


@pytest.mark.parametrize("kind", ["chat", "generate"])
async def test_a_decode_killed_mid_stream_migrates_and_the_stream_is_whole(kind):
    async with fleet(decode_tps=50) as f:
        want = await answers(f, kind, 4, usage=True)
        running = asyncio.ensure_future(answers(f, kind, 4, usage=True))
        dead = f.decodes[0]
        await wait_until(lambda: f.instance(dead).legs.in_flight > 0, timeout=2, what="streams")
        await asyncio.sleep(0.08)  # a few tokens each
        await dead.kill()
        assert_same(await running, want, kind, True)
        assert migrated(f) >= 1
        await assert_settled(f)


async def test_a_stream_with_a_deadline_already_met_still_migrates_after_it():
    # x-slo-ttft-ms is the first token's deadline: once met, a continuation after it has
    # passed keeps its tenant's order but is never refused for it.
    from types import MappingProxyType

    from pdproxy.config.tenants import TenantsConfig, TenantSpec

    tenants = TenantsConfig(tenants=MappingProxyType({"t": TenantSpec()}), header="x-tenant")
    head = {"x-tenant": "t", "x-slo-ttft-ms": "400"}
    # round robin: two of the four go to the decode that cuts (the load-aware pick may send
    # all four to the other one; CI saw it once)
    proxy = {"tenants": tenants, "scheduling": ROUND_ROBIN}
    async with fleet(proxy=proxy, decode_tps=20) as f:
        async with aiohttp.ClientSession(headers=head) as session:
            url = f.proxy.url
            want = [
                await stream(session, url, "completions", payload(i, "completions"))
                for i in range(4)
            ]  # the prefills' speed is measured: predictions run
            f.decodes[0].set_faults(close_after_tokens=8)  # at ~0.4 s and more: past 400 ms
            got = [
                await stream(session, url, "completions", payload(i, "completions"))
                for i in range(4)
            ]
        assert_same(got, want, "completions", False)
        assert migrated(f) >= 1
        assert f.metric("pdproxy_flow_refused_total", tenant="t", reason="deadline") == 0
        await assert_settled(f)
