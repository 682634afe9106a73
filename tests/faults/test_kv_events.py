"""kv-events through pdproxy on sim engines publishing vLLM's KV events: the prefill the
events name is chosen and the prediction equals the engine's reported hit; the fault
matrix's "events stop" and "engine restarts": requests are still served, the index
forgets a restarted engine's blocks and relearns them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from engines.sim import SimConfig, model, running_sim
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.scheduling.kv_keys import block_keys, instance_name
from pdproxy.types import EngineAddress
from tests.faults.harness import (
    GENERATE,
    HEALTH,
    MODEL,
    OUTLIER,
    RETRY,
    TIMEOUTS,
    Fleet,
    assert_settled,
    idle,
    wait_until,
)
from tests.servers import running_proxy
from tests.sim_tokenizer import write_model_dir

BLOCK = 16
# A long shared prefix (8 blocks) then a tail of each request's own.
PREFIX = model.tokenize(" ".join(f"shared{i}" for i in range(8 * BLOCK)))


def prompt(i: int, prefix: list[int] = PREFIX) -> list[int]:
    return prefix + model.tokenize(" ".join(f"own{i}x{k}" for k in range(20)))


@contextlib.asynccontextmanager
async def kv_fleet(
    tmp: Path,
    encoding: str = "map",
    stale_secs: float = 30.0,
    tokenizer: str | None = None,
    more_prefills: tuple[EngineAddress, ...] = (),
    more_decodes: tuple[EngineAddress, ...] = (),
) -> AsyncIterator[Fleet]:
    """2P2D sims publishing their KV events, pdproxy on kv-events in front; ``more_prefills``
    and ``more_decodes`` (not sims of the fleet, not waited for) join the pools."""
    events = f"ipc://{tmp}/{{port}}.events"
    replay = f"ipc://{tmp}/{{port}}.replay"
    common: dict[str, Any] = dict(
        connector="nixl",
        model=MODEL,
        strict=True,
        block_size=BLOCK,
        kv_events_endpoint=events,
        kv_events_replay_endpoint=replay,
        kv_events_encoding=encoding,
    )
    async with contextlib.AsyncExitStack() as stack:
        prefills = [
            await stack.enter_async_context(running_sim(SimConfig(role="prefill", **common)))
            for _ in range(2)
        ]
        decodes = [
            await stack.enter_async_context(running_sim(SimConfig(role="decode", **common)))
            for _ in range(2)
        ]
        scheduling = SchedulingConfig(
            prefill_policy="kv-events",
            decode_policy="kv-events",
            kv_events_endpoint=events,
            kv_events_replay_endpoint=replay,
            kv_events_stale_secs=stale_secs,
            tokenizers=() if tokenizer is None else (("", tokenizer),),
        )
        config = ProxyConfig(
            prefill=(*(EngineAddress(url=s.url) for s in prefills), *more_prefills),
            decode=(*(EngineAddress(url=s.url) for s in decodes), *more_decodes),
            kv_connector="nixl",
            timeouts=TIMEOUTS,
            health=HEALTH,
            outlier=OUTLIER,
            retry=RETRY,
            scheduling=scheduling,
        )
        running = await stack.enter_async_context(running_proxy(config))
        index = running.state.kv_events.index
        names = {instance_name(s.url, 0) for s in prefills + decodes}
        await wait_until(lambda: names <= index.live, timeout=5, what="every engine followed")
        yield await idle(Fleet(running, prefills, decodes))


async def generate(f: Fleet, ids: list[int]) -> dict[str, Any]:
    body = {"model": MODEL, "token_ids": ids, "sampling_params": {"max_tokens": 4}}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f.proxy.url + GENERATE, json=body) as r,
    ):
        assert r.status == 200, await r.text()
        return await r.json()


async def complete(f: Fleet, text: str) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": text, "max_tokens": 4}
    async with (
        aiohttp.ClientSession() as session,
        session.post(f.proxy.url + "/v1/completions", json=body) as r,
    ):
        assert r.status == 200, await r.text()
        return await r.json()


def served_by(f: Fleet) -> list[int]:
    """How many generation legs each prefill served."""
    return [len(s.generation_requests()) for s in f.prefills]


def predicted(f: Fleet, sim, ids: list[int]) -> int:
    index = f.state.kv_events.index
    depth = index.match(block_keys(ids, BLOCK)).get(instance_name(sim.url, 0), 0)
    return min(depth, (len(ids) - 1) // BLOCK) * BLOCK


def cached_tokens(answer: dict[str, Any]) -> int | None:
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    return details.get("cached_tokens")


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_the_prefill_holding_the_prefix_is_chosen_and_the_prediction_is_exact(
    tmp_path, encoding, caplog
):
    caplog.set_level(logging.INFO, logger="pdproxy.access")
    async with kv_fleet(tmp_path, encoding) as f:
        await generate(f, prompt(0))
        holder = next(s for s, n in zip(f.prefills, served_by(f), strict=True) if n)
        await wait_until(lambda: predicted(f, holder, prompt(1)) > 0, timeout=3, what="events")
        expected = predicted(f, holder, prompt(1))
        assert expected == len(PREFIX)
        # The decode publishes the blocks it received, as vLLM's does.
        receiver = next(s for s in f.decodes if s.generation_requests())
        await wait_until(lambda: predicted(f, receiver, prompt(1)) > 0, timeout=3, what="D")
        for i in range(1, 5):
            answer = await generate(f, prompt(i))
            assert cached_tokens(answer) == expected  # the engine's own report, through PD
        assert served_by(f)[f.prefills.index(holder)] == 5  # every one followed the prefix
        lines = [r.fields for r in caplog.records if r.name == "pdproxy.access"]
        # The first request came before any event told the block size: no prediction.
        predictions = [line.get("predicted_prefill_cached") for line in lines]
        assert predictions == [None] + [expected] * 4
        # The decode that received the prefix holds it, and kv-events keeps choosing it.
        assert [line.get("predicted_decode_cached") for line in lines] == [None] + [expected] * 4
        assert [len(s.generation_requests()) for s in f.decodes].count(5) == 1
        status = f.state.kv_events.status()
        assert status["indexed_blocks"] > 0 and status["max_blocks"] > 0
        # The self-check's figures: four checked predictions, all exact.
        predicted_total = f.metric("pdproxy_kv_events_cached_tokens_total", kind="predicted")
        assert predicted_total == 4 * expected
        assert f.metric("pdproxy_kv_events_cached_tokens_total", kind="actual") == 4 * expected
        assert f.metric("pdproxy_kv_events_prediction_error_tokens_total") == 0
        await assert_settled(f)


async def test_a_text_completion_is_scored_exactly_by_the_local_tokenizer(tmp_path, caplog):
    """No --render-once: pdproxy tokenizes the text itself (--tokenizer, a tokenizer.json
    whose ids are the sim's), routes to the prefill holding the prefix and predicts the hit
    the sim reports; the engines still get the text."""
    caplog.set_level(logging.INFO, logger="pdproxy.access")
    shared = " ".join(f"shared{i}" for i in range(8 * BLOCK))
    texts = [shared + " " + " ".join(f"own{i}x{k}" for k in range(20)) for i in range(5)]
    folder = write_model_dir(tmp_path / "tokenizer", texts)
    async with kv_fleet(tmp_path, tokenizer=str(folder)) as f:
        await complete(f, texts[0])
        holder = next(s for s, n in zip(f.prefills, served_by(f), strict=True) if n)
        ids = model.tokenize(texts[1])
        await wait_until(lambda: predicted(f, holder, ids) > 0, timeout=3, what="events")
        expected = predicted(f, holder, ids)
        assert expected == len(PREFIX)
        other = next(s for s in f.prefills if s is not holder)
        for text in texts[1:]:
            assert cached_tokens(await complete(f, text)) == expected  # the sim's own report
        assert served_by(f)[f.prefills.index(holder)] == 5 and not other.generation_requests()
        lines = [r.fields for r in caplog.records if r.name == "pdproxy.access"]
        assert [line.get("predicted_prefill_cached") for line in lines] == [None] + [expected] * 4
        assert f.metric("pdproxy_kv_events_prediction_error_tokens_total") == 0
        assert f.metric("pdproxy_kv_events_cached_tokens_total", kind="actual") == 4 * expected
        # The ids only fed scoring: every engine got the client's text.
        bodies = [r.body for s in f.engines for r in s.generation_requests()]
        assert {b["prompt"] for b in bodies} <= set(texts) and len(bodies) == 10
        await assert_settled(f)


async def test_events_stop_the_engine_falls_back_to_the_approximate_index_and_recovers(tmp_path):
    """Events stop with no gap to show it: predictions go wrong against the engine's own
    report, the engine is scored approximately; requests are served all along; events
    resume and predictions agree again: it is trusted again."""
    async with kv_fleet(tmp_path) as f:
        p, other = f.prefills
        f.instance(other).legs.work = 100.0  # overloaded: every request on p
        name = instance_name(p.url, 0)
        index = f.state.kv_events.index
        warm = model.tokenize(" ".join(f"warm{i}" for i in range(2 * BLOCK)))
        await generate(f, warm)  # heard: the index knows the block size
        await wait_until(lambda: index.block_size == BLOCK, timeout=3, what="first events")
        p.kv_events.faults.stopped = True
        for i in range(6):  # the first stores the prefix, unheard; 5 wrong predictions
            assert (await generate(f, prompt(i)))["choices"]
        assert name not in index.live and name in index.followed
        check = f.state.kv_events.status()["instances"][name]["self_check"]
        assert check["distrusted"] and check["wrong"] == 5
        p.kv_events.faults.stopped = False
        other_prefix = model.tokenize(" ".join(f"tenant{i}" for i in range(8 * BLOCK)))
        await generate(f, prompt(0, other_prefix))  # stored and heard
        await wait_until(
            lambda: predicted(f, p, prompt(1, other_prefix)) == len(other_prefix),
            timeout=3,
            what="events again",
        )
        for i in range(1, 6):
            answer = await generate(f, prompt(i, other_prefix))
            assert cached_tokens(answer) == len(other_prefix)
        assert name in index.live  # five right in a row
        f.instance(other).legs.work = 0.0
        await assert_settled(f)


async def test_events_stop_the_engine_goes_stale_by_time_and_returns_when_they_flow(tmp_path):
    """Events stop, and the engine is sent work that stores blocks: after
    ``--kv-events-stale-secs`` without a batch it is stale (scored approximately, shown in
    /status) before the self-check has seen five wrong predictions; it returns with its
    next batch. Requests are served all along."""
    stale_secs = 0.5
    async with kv_fleet(tmp_path, stale_secs=stale_secs) as f:
        p, other = f.prefills
        f.instance(other).legs.work = 100.0  # overloaded: every request on p
        name = instance_name(p.url, 0)
        index = f.state.kv_events.index
        warm = model.tokenize(" ".join(f"warm{i}" for i in range(2 * BLOCK)))
        await generate(f, warm)
        # p's own batch, not only the decode's: one still in flight after the stop would
        # end the wait that prompt(0) starts, and prompt(1) would find nothing stale
        await wait_until(lambda: predicted(f, p, warm) > 0, timeout=3, what="p's warm events")
        assert index.block_size == BLOCK and index.staleness.waiting_since(name) is None

        def rank() -> dict[str, Any]:
            return f.state.kv_events.status()["instances"][name]

        p.kv_events.faults.stopped = True
        assert (await generate(f, prompt(0)))["choices"]  # stores the prefix, unheard
        assert name in index.live and not rank()["stale"]
        await asyncio.sleep(stale_secs)
        assert (await generate(f, prompt(1)))["choices"]  # its decision sweeps: stale
        assert rank()["stale"] and not rank()["live"] and name in index.followed
        assert not rank()["self_check"]["distrusted"]  # time, not the self-check
        p.kv_events.faults.stopped = False
        other_prefix = model.tokenize(" ".join(f"tenant{i}" for i in range(8 * BLOCK)))
        assert (await generate(f, prompt(0, other_prefix)))["choices"]  # stored and heard
        await wait_until(lambda: not rank()["stale"], timeout=3, what="events flow again")
        assert name in index.live
        f.instance(other).legs.work = 0.0
        await assert_settled(f)


async def test_an_engine_restart_clears_its_blocks_and_they_are_relearned(tmp_path):
    async with kv_fleet(tmp_path) as f:
        await generate(f, prompt(0))
        holder = next(s for s, n in zip(f.prefills, served_by(f), strict=True) if n)
        await wait_until(lambda: predicted(f, holder, prompt(1)) > 0, timeout=3, what="events")
        await holder.restart()  # an empty cache, events numbered from 0 again
        name = instance_name(holder.url, 0)
        index = f.state.kv_events.index
        await wait_until(
            lambda: f.state.kv_events.status()["instances"][name]["reconnects"] >= 1,
            timeout=3,
            what="the restart seen",
        )
        assert predicted(f, holder, prompt(1)) == 0  # its old blocks went
        others = [s for s in f.prefills if s is not holder]
        for sim in others:  # keep the next request on the restarted one
            f.instance(sim).legs.work = 100.0
        await generate(f, prompt(7))
        for sim in others:
            f.instance(sim).legs.work = 0.0
        await wait_until(
            lambda: predicted(f, holder, prompt(8)) == len(PREFIX), timeout=3, what="relearned"
        )
        assert index.unchained == 0
        await assert_settled(f)


async def test_instances_added_by_the_admin_api_say_where_their_events_are(tmp_path):
    """No template: each instance's own endpoint (the admin add body's field; a static
    instance's address)."""
    common: dict[str, Any] = dict(connector="nixl", model=MODEL, strict=True, block_size=BLOCK)
    events = f"ipc://{tmp_path}/{{port}}.events"
    async with contextlib.AsyncExitStack() as stack:
        p, d = [
            await stack.enter_async_context(
                running_sim(SimConfig(role=role, kv_events_endpoint=events, **common))
            )
            for role in ("prefill", "decode")
        ]
        # A static prefill whose events are not followed: the approximate index scores it.
        silent = await stack.enter_async_context(running_sim(SimConfig(role="prefill", **common)))
        own = events.replace("{port}", str(d.port))
        config = ProxyConfig(
            prefill=(EngineAddress(url=silent.url),),
            decode=(EngineAddress(url=d.url, kv_events_endpoint=own),),
            kv_connector="nixl",
            admin_api_key="k" * 32,
            scheduling=SchedulingConfig(prefill_policy="kv-events"),
        )
        proxy = await stack.enter_async_context(running_proxy(config))
        headers = {"X-API-Key": "k" * 32}
        async with aiohttp.ClientSession() as session:
            body = {
                "type": "prefill",
                "instance": p.url.split("://")[1],
                "kv_events_endpoint": events.replace("{port}", str(p.port)),
            }
            async with session.post(proxy.url + "/instances/add", json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
            bad = {"type": "decode", "instance": "127.0.0.1:9", "kv_events_endpoint": "http://x"}
            async with session.post(proxy.url + "/instances/add", json=bad, headers=headers) as r:
                assert r.status == 400 and "kv_events_endpoint" in await r.text()
        fleet = proxy.state.kv_events
        names = {instance_name(p.url, 0), instance_name(d.url, 0)}
        await wait_until(lambda: names <= fleet.index.live, timeout=5, what="followed")
        f = await idle(Fleet(proxy, [p, silent], [d]))
        assert instance_name(silent.url, 0) not in fleet.status()["instances"]
        f.instance(silent).legs.work = 100.0  # overloaded: the followed prefill serves
        await generate(f, prompt(0))
        await wait_until(lambda: predicted(f, p, prompt(1)) == len(PREFIX), timeout=3, what="ev")
        assert cached_tokens(await generate(f, prompt(1))) == len(PREFIX)
        f.instance(silent).legs.work = 0.0
        gone = instance_name(p.url, 0)
        subscriber = fleet._running[gone].task
        proxy.state.registry.remove(p.url)  # it leaves (drained, expired): its entries go
        assert gone not in fleet.index.followed and gone not in fleet.status()["instances"]
        assert predicted(f, p, prompt(1)) == 0
        await wait_until(subscriber.done, timeout=3, what="its subscriber stopped")


async def test_a_cached_prefix_behind_a_long_queue_loses_to_an_idle_prefill(tmp_path):
    """The prefill leg's cost in tokens of work: the holder's queue plus the prompt's
    uncached tail against the whole prompt on an idle prefill."""
    async with kv_fleet(tmp_path) as f:
        await generate(f, prompt(0))
        holder = next(s for s, n in zip(f.prefills, served_by(f), strict=True) if n)
        idle_one = next(s for s in f.prefills if s is not holder)
        await wait_until(lambda: predicted(f, holder, prompt(1)) > 0, timeout=3, what="events")
        n, hit = len(prompt(1)), len(PREFIX)
        assert predicted(f, holder, prompt(1)) == hit and predicted(f, idle_one, prompt(1)) == 0
        legs = f.instance(holder).legs
        share = SchedulingConfig().kv_queue_weight  # of the queue a new prompt waits for
        # A queue shorter than the hit saves: queue * share + (n - hit) < n. The holder wins.
        legs.queued_tokens = (hit - 10.0) / share
        assert cached_tokens(await generate(f, prompt(1))) == hit
        assert served_by(f)[f.prefills.index(holder)] == 2
        # A queue longer than the hit saves: the idle prefill computes it all, sooner.
        legs.queued_tokens = (hit + 10.0) / share
        assert cached_tokens(await generate(f, prompt(2))) == 0
        assert served_by(f)[f.prefills.index(idle_one)] == 1
        assert n - hit < hit  # the prompt's own tail is shorter than its shared prefix
        legs.queued_tokens = 0.0
        await assert_settled(f)
