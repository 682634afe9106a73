"""Hostile prefills against NIXL push (issue 32): a prefill whose answers would kill a push
decode (a required key left out: vLLM 0.32's push decode reads them unchecked, and a
``KeyError`` in its scheduler kills the engine), and one that answers another prefill's
engine id and side channel (a decode sent there registers where nothing will write).

A real pdproxy (``--kv-connector nixl-push --push-dispatch concurrent``, round-robin) in front
of a legitimate push sim, a liar (a relay to a push sim of its own that rewrites its answers'
``kv_transfer_params``) and one push decode, with ``/health`` watched; every client's answer
is checked against a single engine's, and the decode must stay alive and in rotation.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from engines.sim import SimConfig, running_sim
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.upstream import Timeouts
from pdproxy.types import EngineAddress
from tests.faults.harness import wait_until
from tests.hostile.test_first_token_and_blocks import LyingPrefill, lying_prefill
from tests.hostile.test_instances import watched
from tests.integration.conftest import MODEL, ROUND_ROBIN
from tests.servers import RunningProxy, running_proxy


@dataclass
class Fleet:
    proxy: RunningProxy
    prefill: Any
    hostile: LyingPrefill
    decode: Any
    single: Any

    async def request(self, i: int) -> None:
        """One streamed completion through pdproxy: the client's own answer, whole."""
        body = {"model": MODEL, "prompt": f"push hostile {i} " * 6, "max_tokens": 6}
        async with aiohttp.ClientSession() as s:
            async with s.post(
                self.proxy.url + "/v1/completions", json={**body, "stream": True}
            ) as r:
                raw = await r.read()
                assert r.status == 200 and b'"error"' not in raw, raw[-300:]
            async with s.post(self.single.url + "/v1/completions", json=body) as r:
                reference = orjson.loads(await r.read())["choices"][0]["text"]
        text = "".join(
            c.get("text") or ""
            for line in raw.split(b"\n")
            if line.startswith(b"data: {")
            for c in orjson.loads(line[6:])["choices"]
        )
        assert text == reference


@contextlib.asynccontextmanager
async def fleet() -> AsyncIterator[Fleet]:
    common: dict[str, Any] = dict(model=MODEL, connector="nixl-push", strict=True)
    async with (
        running_sim(SimConfig(role="prefill", **common)) as p,
        running_sim(SimConfig(role="prefill", **common)) as p2,
        running_sim(SimConfig(role="decode", **common)) as d,
        running_sim(SimConfig(role="both", model=MODEL)) as single,
        lying_prefill(p2.url) as hostile,
        running_proxy(
            ProxyConfig(
                prefill=(EngineAddress(url=p.url), EngineAddress(url=hostile.url)),
                decode=(EngineAddress(url=d.url),),
                kv_connector="nixl-push",
                push_dispatch="concurrent",
                scheduling=ROUND_ROBIN,
                timeouts=Timeouts(push_wait=2.0),
            )
        ) as running,
        watched(running),
    ):
        await wait_until(lambda: running.state.registry.pools().by_model, timeout=5, what="up")
        yield Fleet(running, p, hostile, d, single)


def _stranded(f: Fleet) -> bool:
    return f.proxy.state.outliers.stranded(f.proxy.state.registry.get(f.decode.url))


async def test_an_answer_missing_a_key_the_push_decode_reads_never_reaches_it() -> None:
    async with fleet() as f:

        def drop(params: dict[str, Any]) -> None:
            del params["remote_request_id"]

        f.hostile.rewrite = drop
        for i in range(8):  # the liar's answers are never learned: its legs stay serial
            await f.request(i)
        assert f.hostile.lies >= 4
        assert f.decode.engine.dead is None, f.decode.engine.dead
        assert not _stranded(f)


async def test_an_answer_naming_another_prefills_side_is_not_believed() -> None:
    async with fleet() as f:

        def claim_legit(params: dict[str, Any]) -> None:
            params["remote_engine_id"] = f.prefill.config.engine_id
            params["remote_port"] = f.prefill.kv_port

        f.hostile.rewrite = claim_legit  # from its first answer: never learned, always serial
        for i in range(8):
            await f.request(i)
        assert f.hostile.lies >= 4
        assert f.proxy.state.orchestrator.push_status()["prefill_ranks_known"] == 1
        assert f.decode.engine.dead is None
        assert not _stranded(f)  # no decode was sent where nothing would write
