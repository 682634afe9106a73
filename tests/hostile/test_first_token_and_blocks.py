"""Hostile peers against what pdproxy learns of block sizes (issue 29): a prefill claiming
another's engine id, a prefill listing too few KV blocks for its prompt
(``--first-token-from-prefill``), and a KV-event publisher stating an odd block size
(``kv-events``).

Each case runs a real pdproxy with NIXL sims (the decode dies on the block-size edge as
vLLM 0.32's does) while ``/health`` is probed (``watched``: p99 under 100 ms, open files
bounded); every client's answer is checked against a single engine's for its own prompt.
The hostile prefill is a relay in front of a real sim that rewrites its answers'
``kv_transfer_params``; the hostile publisher a real ZMQ PUB socket on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import orjson
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from engines.ports import free_port
from engines.sim import SimConfig, model, running_sim
from engines.sim.kv_events import KVEventPublisher, stored
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.resilience import OutlierConfig
from pdproxy.scheduling.kv_keys import block_keys, instance_name
from pdproxy.types import EngineAddress
from tests.faults.harness import wait_until
from tests.faults.test_kv_events import (
    PREFIX,
    cached_tokens,
    generate,
    kv_fleet,
    predicted,
    prompt,
    served_by,
)
from tests.hostile.test_instances import watched
from tests.hostile.test_kv_events import _status
from tests.integration.conftest import MODEL, ROUND_ROBIN
from tests.integration.test_first_token import GENERATE, _generate, _ids, _post, _words
from tests.servers import RunningProxy, running_proxy

Rewrite = Callable[[dict[str, Any]], None]


class LyingPrefill:
    """A prefill engine relayed to a real sim, whose answers' ``kv_transfer_params`` are
    rewritten by ``rewrite`` once it is set (``lies`` counts them)."""

    def __init__(self, target: str, session: aiohttp.ClientSession) -> None:
        self.target = target
        self.session = session
        self.rewrite: Rewrite | None = None
        self.lies = 0
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        skip = ("host", "content-length", "transfer-encoding")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in skip}
        body, url = await request.read(), self.target + request.path_qs
        async with self.session.request(
            request.method, url, data=body, headers=headers
        ) as upstream:
            raw = await upstream.read()
            status, kind = upstream.status, upstream.headers.get("Content-Type", "")
        if self.rewrite is not None and request.method == "POST" and status == 200:
            answer = orjson.loads(raw)
            if isinstance(answer.get("kv_transfer_params"), dict):
                self.rewrite(answer["kv_transfer_params"])
                self.lies += 1
                raw = orjson.dumps(answer)
        return web.Response(status=status, body=raw, headers={"Content-Type": kind})


@contextlib.asynccontextmanager
async def lying_prefill(target: str) -> AsyncIterator[LyingPrefill]:
    async with aiohttp.ClientSession() as session:
        lying = LyingPrefill(target, session)
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", lying.handle)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        lying.url = f"http://127.0.0.1:{port}"
        try:
            yield lying
        finally:
            await runner.cleanup()


@dataclass
class Pair:
    """A legitimate prefill, a lying one (a relay to a sim of its own), one decode, a single
    engine for reference, pdproxy (round-robin, the first token from the prefill) watched."""

    proxy: RunningProxy
    prefill: Any
    hostile: LyingPrefill
    hostile_sim: Any
    decode: Any
    single: Any

    async def request(self, prompt: str) -> tuple[Any, bytes]:
        """``prompt`` through pdproxy; the prefill that served it (the legitimate sim or
        the liar) and the answer, checked to be this client's own, whole and without error."""
        before = len(self.prefill.generation_requests())
        status, raw = await _post(self.proxy.url, GENERATE, _generate(prompt), rid=prompt[:24])
        assert status == 200 and b'"error"' not in raw, raw[-400:]
        _, reference = await _post(self.single.url, GENERATE, _generate(prompt), rid=prompt[:24])
        assert _ids(raw) == _ids(reference), prompt  # its own tokens, not another client's
        served = len(self.prefill.generation_requests()) > before
        return self.prefill if served else self.hostile, raw

    def decode_leg(self, prompt: str) -> list[int]:
        """The token ids the decode was sent for ``prompt``'s request."""
        ids = model.tokenize(prompt)
        (leg,) = [
            r for r in self.decode.generation_requests() if r.body["token_ids"][: len(ids)] == ids
        ]
        return list(leg.body["token_ids"])


@contextlib.asynccontextmanager
async def pair(**proxy: Any) -> AsyncIterator[Pair]:
    common: dict[str, Any] = dict(model=MODEL, connector="nixl", strict=True)
    async with (
        running_sim(SimConfig(role="prefill", **common)) as p,
        running_sim(SimConfig(role="prefill", **common)) as p2,
        running_sim(SimConfig(role="decode", **common)) as d,
        running_sim(SimConfig(role="both", model=MODEL, connector="nixl")) as single,
        lying_prefill(p2.url) as hostile,
        running_proxy(
            ProxyConfig(
                prefill=(EngineAddress(url=p.url), EngineAddress(url=hostile.url)),
                decode=(EngineAddress(url=d.url),),
                kv_connector="nixl",
                scheduling=ROUND_ROBIN,
                first_token_from_prefill=True,
                **proxy,
            )
        ) as running,
        watched(running),
    ):
        await wait_until(lambda: running.state.registry.pools().by_model, timeout=5, what="up")
        yield Pair(running, p, hostile, p2, d, single)


async def until_served_by(pair: Pair, served: Any, prompts: list[str]) -> str:
    """``prompts`` in turn until ``served`` took one (round-robin: two at most): that one."""
    for text in prompts:
        if (await pair.request(text))[0] is served:
            return text
    raise AssertionError(f"{served} took none of {len(prompts)} requests")


async def test_a_prefill_claiming_anothers_engine_id_never_sets_its_block_size() -> None:
    # Issue 29: bounds were keyed by the engine id a prefill reports. A liar claiming the
    # legitimate prefill's id with 24 tokens a block narrowed its bounds to 24 and more, and
    # the legitimate prefill's next prompt on its edge (32 tokens in 2 blocks of 16) took
    # the first-token path: the decode was sent 33 tokens for 2 blocks and died (as vLLM
    # 0.32's NIXL worker asserts), and every client after it got errors.
    async with pair() as d:
        legit = d.prefill.config.engine_id

        def claim_legit(params: dict[str, Any]) -> None:
            # the liar's own blocks (the decode pulls as many as its prompt needs: it lives,
            # and recomputes what the wrong engine id cannot fetch), "24 tokens a block"
            params["remote_engine_id"] = legit
            params["remote_num_tokens"] = 24 * len(params["remote_block_ids"][0])

        d.hostile.rewrite = claim_legit
        await until_served_by(d, d.hostile, [_words(5, f"poison{i}") for i in range(3)])
        text = await until_served_by(d, d.prefill, [_words(32, f"edge{i}") for i in range(3)])
        assert d.decode_leg(text) == model.tokenize(text)  # the usual decode: no t1
        assert d.decode.engine.dead is None, d.decode.engine.dead
        for i in range(4):  # both prefills still routed, every client its own answer
            await d.request(_words(9, f"after{i}"))


async def test_a_prefill_listing_too_few_blocks_is_not_trusted_and_is_ejected() -> None:
    # Issue 29: a prefill listing fewer blocks than its prompt needs (2 for 49 tokens, its
    # blocks known to hold 16 at most) was trusted: the decode was sent prompt + t1, and
    # the liar stayed in rotation. Now the usual decode, and its leg counts as failed: at
    # the default three in a row it is ejected (its prefill leg's own success reset the
    # row before each lie, so it was never ejected, until the lie undid that success).
    async with pair(outlier=OutlierConfig(base_ejection=30.0)) as d:
        await until_served_by(d, d.hostile, [_words(33, f"learn{i}") for i in range(3)])

        def too_few(params: dict[str, Any]) -> None:
            params["remote_block_ids"] = [params["remote_block_ids"][0][:2]]
            del params["remote_host"]  # the decode recomputes rather than asserting

        d.hostile.rewrite = too_few
        served = []
        for i in range(40):
            text = _words(49, f"few{i}")
            prefill, _ = await d.request(text)
            served.append(prefill)
            if prefill is d.hostile:
                assert d.decode_leg(text) == model.tokenize(text)  # never the fast path
            if served.count(d.hostile) == 3:
                break
        for i in range(5):  # ejected after its third lie
            assert (await d.request(_words(49, f"after{i}")))[0] is d.prefill
        metric = "pdproxy_ejections_total"
        labels = {"role": "prefill", "url": d.hostile.url}
        assert d.proxy.state.metrics.registry.get_sample_value(metric, labels) == 1
        assert d.decode.engine.dead is None


@pytest.mark.parametrize("size", [10**18, 32], ids=["1e18", "another"])
async def test_one_publishers_block_size_never_sets_the_others(tmp_path: Path, size: int) -> None:
    # Issue 29: the index kept one block size, the last BlockStored's. One publisher's empty
    # BlockStored of 1e18 (or of any size but the fleet's) cut every request's keys at it:
    # every engine's prediction was 0, five wrong in a row distrusted each, and a prefix no
    # longer chose its prefill.
    port = free_port()
    async with running_sim(SimConfig(role="prefill", model=MODEL, connector="nixl")) as liar:
        hostile = EngineAddress(url=liar.url, kv_events_endpoint=f"tcp://127.0.0.1:{port}")
        publisher = KVEventPublisher(f"tcp://127.0.0.1:{port}", None, encoding="map")
        publisher.start()
        try:
            async with (
                kv_fleet(tmp_path, more_prefills=(hostile,)) as f,
                watched(f.proxy, fd_slack=96),
            ):
                f.instance(liar).legs.work = 100.0  # its sim is never chosen
                index = f.state.kv_events.index
                name = instance_name(liar.url, 0)
                seen = 0

                async def attack() -> None:
                    nonlocal seen  # past ZMQ's slow joiner: until pdproxy took one
                    for _ in range(200):
                        publisher.publish([stored([], None, [], size, "map")])
                        await asyncio.sleep(0.01)
                        rank = f.state.kv_events.status()["instances"][name]
                        if rank["batches"] + rank["malformed"] > seen:
                            seen = rank["batches"] + rank["malformed"]
                            return
                    raise AssertionError("the hostile publisher was never heard")

                await generate(f, prompt(0))
                holder = next(s for s, n in zip(f.prefills, served_by(f), strict=True) if n)
                await wait_until(
                    lambda: predicted(f, holder, prompt(1)) == len(PREFIX), timeout=3, what="heard"
                )
                for i in range(1, 7):
                    await attack()  # just before the request is routed
                    assert predicted(f, holder, prompt(i)) == len(PREFIX)  # still indexed
                    assert cached_tokens(await generate(f, prompt(i))) == len(PREFIX)
                    made = f.metric("pdproxy_kv_events_cached_tokens_total", kind="predicted")
                    assert made == i * len(PREFIX), (i, made, index.block_size)  # not zeroed
                assert served_by(f)[f.prefills.index(holder)] == 7  # the prefix chose it
                assert not liar.generation_requests()
                status = await _status(f.proxy.url)
                legit = [instance_name(s.url, 0) for s in f.engines]
                assert all(status["instances"][n]["live"] for n in legit), status
                assert f.metric("pdproxy_kv_events_prediction_error_tokens_total") == 0
                assert index.block_size == 16
                if size > 4096:
                    assert status["instances"][name]["malformed"] >= 6  # never applied
                else:
                    assert not status["instances"][name]["live"]  # it alone falls back
                # the decodes' predictions are checked too (by their own stores), all right
                checks = [index.check.figures.get(instance_name(s.url, 0)) for s in f.decodes]
                assert sum(c.checked for c in checks if c) >= 1, checks
                assert not any(c.wrong for c in checks if c), checks
        finally:
            await publisher.aclose()


async def _relay_with_lies(source: str, publisher: KVEventPublisher) -> None:
    """A decode's own events, forwarded (renumbered) by a publisher that also lies."""
    context = zmq.asyncio.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(source)
    try:
        while True:
            _topic, _seq, batch = await sub.recv_multipart()
            publisher.publish(msgpack.unpackb(batch)[1])
    finally:
        sub.close(0)
        context.term()


async def test_a_decodes_lying_publisher_is_caught_by_its_own_stores(tmp_path: Path) -> None:
    # Issue 29: a decode's predictions were never checked (vLLM reports only the
    # prefill's hit), so a decode's publisher claiming blocks its engine lacks drew every
    # such prompt to it, for ever. Its engine stores the blocks it lacked from the first
    # on: five such stores in a row, and only that decode is scored approximately.
    own, lies = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    config = SimConfig(role="decode", model=MODEL, connector="nixl", strict=True, block_size=16)
    config = replace(config, kv_events_endpoint=own, kv_events_encoding="map")
    async with running_sim(config) as liar:
        publisher = KVEventPublisher(lies, None, encoding="map")
        publisher.start()
        relay = asyncio.create_task(_relay_with_lies(own, publisher))
        try:
            hostile = EngineAddress(url=liar.url, kv_events_endpoint=lies)
            async with (
                kv_fleet(tmp_path, more_decodes=(hostile,)) as f,
                watched(f.proxy, fd_slack=96),
            ):
                index = f.state.kv_events.index
                name = instance_name(liar.url, 0)
                await wait_until(lambda: name in index.live, timeout=5, what="liar followed")
                for i in range(5):
                    ids = model.tokenize(" ".join(f"lie{i}x{k}" for k in range(64)))
                    claim = stored([9000 + i], None, ids[:16], 16, "map")
                    for _ in range(300):  # past ZMQ's slow joiner: until it is indexed
                        if index.match(block_keys(ids, 16)).get(name):
                            break
                        publisher.publish([claim])
                        await asyncio.sleep(0.01)
                    await generate(f, ids)
                    assert liar.generation_requests(), "the claimed block drew the prompt"
                await wait_until(lambda: name not in index.live, timeout=3, what="distrusted")
                figures = index.check.figures[name]
                assert (figures.checked, figures.wrong) == (5, 5), figures
                legit = [instance_name(s.url, 0) for s in f.engines]
                assert all(n in index.live for n in legit)  # the others stay exact
                for i in range(3):  # every client still served
                    await generate(f, prompt(i))
        finally:
            relay.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await relay
            await publisher.aclose()
