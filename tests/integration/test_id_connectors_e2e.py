"""End to end through pdproxy with self-registering sims, 2P2D, per id-embedding connector.

Each sim registers itself over ZMQ in the format its connector's engines use (Mooncake
engines do not register: they are given as static prefills with their bootstrap port).
Output must equal a single engine's, the KV must cross the wire to the peer named in the
request id, and the id must parse with vLLM's own regexes.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from dataclasses import dataclass

import aiohttp
import orjson
import pytest

from engines.ports import free_port
from engines.sim import SimConfig, running_sim
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.registry import RegistryConfig
from pdproxy.types import EngineAddress
from tests.integration.conftest import MODEL, ROUND_ROBIN
from tests.servers import running_proxy

MORIIO_PREFILL = re.compile(r"___prefill_addr_(.+?)___decode_addr_")
MORIIO_DECODE = re.compile(r"___decode_addr_(.+)_[0-9a-f]{32}(?:-.*)?$")
P2P_PRODUCER = re.compile(r"___decode_addr_(.*):(\d+)")
P2P_CONSUMER = re.compile(r"___prefill_addr_(.*):(\d+)___")


@dataclass(frozen=True)
class Case:
    connector: str
    register_format: str | None  # None: static instances (Mooncake)
    transfer_mode: str | None = None
    dp_size: int = 1

    @property
    def id_embedded(self) -> bool:
        return self.connector in ("moriio", "p2p-nccl")


CASES = [
    Case("moriio", "moriio", "READ"),
    Case("moriio", "moriio", "WRITE"),
    Case("moriio", "moriio-legacy", "READ"),
    Case("p2p-nccl", "p2p"),
    Case("mooncake", None),
    Case("moriio", "moriio", "READ", dp_size=2),
    Case("moriio", "moriio", "WRITE", dp_size=2),
    Case("mooncake", None, dp_size=2),
]


@contextlib.asynccontextmanager
async def fleet(case: Case):
    port = free_port()
    sim = dict(
        connector=case.connector,
        model=MODEL,
        strict=True,
        kv_wait_timeout_s=3.0,
        dp_size=case.dp_size,
    )
    if case.transfer_mode:
        sim["transfer_mode"] = case.transfer_mode
    if case.register_format:
        sim.update(
            register=f"tcp://127.0.0.1:{port}",
            register_format=case.register_format,
            register_interval_s=0.2,
        )
    async with contextlib.AsyncExitStack() as stack:
        prefills = [
            await stack.enter_async_context(running_sim(SimConfig(role="prefill", **sim)))
            for _ in range(2)
        ]
        decodes = [
            await stack.enter_async_context(running_sim(SimConfig(role="decode", **sim)))
            for _ in range(2)
        ]
        single = await stack.enter_async_context(running_sim(SimConfig(role="both", model=MODEL)))
        static = {}
        if case.register_format is None:
            static = dict(
                prefill=tuple(
                    EngineAddress(url=p.url, bootstrap_url=p.bootstrap_url) for p in prefills
                ),
                decode=tuple(EngineAddress(url=d.url) for d in decodes),
            )
        config = ProxyConfig(
            kv_connector=case.connector,
            registry=RegistryConfig(port=port, host="127.0.0.1", ttl=2.0, sweep_interval=0.1),
            scheduling=ROUND_ROBIN,
            **static,
        )
        proxy = await stack.enter_async_context(running_proxy(config))
        for _ in range(300):
            snap = proxy.state.registry.snapshot()
            if len(snap.prefill) == 2 and len(snap.decode) == 2:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("the sims did not become routable")
        yield proxy, prefills, decodes, single


def _text(raw: bytes, chat: bool, stream: bool) -> str:
    def piece(c):
        return (
            ((c.get("delta") or c.get("message") or {}).get("content") or "")
            if chat
            else c.get("text", "")
        )

    if not stream:
        return "".join(piece(c) for c in orjson.loads(raw)["choices"])
    events = [orjson.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]
    assert not any("error" in e for e in events), events
    return "".join(piece(c) for e in events for c in e.get("choices", []))


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=lambda c: f"{c.connector}-{c.register_format}-{c.transfer_mode}-dp{c.dp_size}",
)
async def test_connector_end_to_end(case):
    async with fleet(case) as (proxy, prefills, decodes, single), aiohttp.ClientSession() as s:
        for i, (chat, stream) in enumerate(
            [(False, False), (True, True), (False, True), (True, False)] * 2
        ):
            body = {"model": MODEL, "max_tokens": 8, "stream": stream}
            text = f"request {i} travels through a {case.connector} deployment"
            path = "/v1/chat/completions" if chat else "/v1/completions"
            body["messages" if chat else "prompt"] = (
                [{"role": "user", "content": text}] if chat else text
            )
            async with s.post(proxy.url + path, json=body) as r:
                assert r.status == 200, await r.text()
                got = _text(await r.read(), chat, stream)
            async with s.post(single.url + path, json={**body, "stream": False}) as r:
                assert got == _text(await r.read(), chat, False)
        _check_kv_moved(prefills, decodes)
        _check_ids_and_peers(case, prefills, decodes)
        assert all(
            e.counters.contract_violations == 0 and e.counters.kv_load_failures == 0
            for e in prefills + decodes
        )


def _check_kv_moved(prefills, decodes):
    sent = [p.counters.kv_bytes_sent for p in prefills]
    received = [d.counters.kv_bytes_received for d in decodes]
    assert all(sent) and all(received) and sum(sent) == sum(received)
    assert all(d.counters.tokens_external_kv_transfer > 0 for d in decodes)


def _check_ids_and_peers(case, prefills, decodes):
    p_by_id = {r.headers["x-request-id"]: (p, r) for p in prefills for r in p.generation_requests()}
    for d in decodes:
        for record in d.generation_requests():
            rid = record.headers["x-request-id"]
            p, p_record = p_by_id[rid]  # the same id on both legs, exactly one prefill
            p_params, d_params = (
                p_record.body.get("kv_transfer_params"),
                record.body.get("kv_transfer_params"),
            )
            if case.id_embedded:
                internal = f"cmpl-{rid}-0-1a2b3c4d"  # the engine's internal form must parse too
                if case.connector == "moriio":
                    assert MORIIO_PREFILL.search(internal).group(1) == p.zmq_address
                    assert MORIIO_DECODE.search(internal).group(1) == d.zmq_address
                else:
                    host, port = P2P_PRODUCER.search(internal).groups()
                    assert f"{host}:{port}" == d.zmq_address
                    host, port = P2P_CONSUMER.search(internal).groups()
                    assert f"{host}:{port}" == p.zmq_address
            if case.connector in ("moriio", "mooncake"):
                assert p_params["transfer_id"] == d_params["transfer_id"]
            rank = p_record.headers.get("x-data-parallel-rank")
            if case.dp_size > 1:
                assert rank is not None
                if case.connector == "moriio":
                    assert d_params["remote_dp_rank"] == int(rank)
                else:
                    assert d_params["remote_engine_id"] == p.engine_ids[int(rank)]
            if case.connector == "p2p-nccl":
                assert p_params is None and d_params is None
    ranks = {
        r.headers.get("x-data-parallel-rank") for p in prefills for r in p.generation_requests()
    }
    assert len(ranks) == case.dp_size  # every DP rank got traffic
