"""The admin API: key matrix, address validation, duplicates, probes, drains, no key in logs."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
import pytest

from engines.ports import free_port
from engines.sim import SimConfig, running_sim
from pdproxy.config.proxy import ProxyConfig
from pdproxy.types import EngineAddress
from tests.integration.conftest import MODEL
from tests.servers import running_proxy

KEY = "s3cr3t-admin-key-value"
WRONG = "wrong-key-also-secret"


@contextlib.asynccontextmanager
async def admin_proxy(n_decode=1, key=KEY, cidrs=(), **sim):
    async with contextlib.AsyncExitStack() as stack:
        p = await stack.enter_async_context(running_sim(SimConfig(role="prefill", model=MODEL)))
        ds = [
            await stack.enter_async_context(
                running_sim(SimConfig(role="decode", model=MODEL, **sim))
            )
            for _ in range(n_decode)
        ]
        config = ProxyConfig(
            prefill=(EngineAddress(url=p.url),),
            decode=tuple(EngineAddress(url=d.url) for d in ds),
            admin_api_key=key,
            admin_allow_cidrs=cidrs,
            model=MODEL,
        )
        proxy = await stack.enter_async_context(running_proxy(config))
        yield proxy, p, ds


async def _admin(proxy, path, body=None, key=KEY, method="POST"):
    headers = {} if key is None else {"X-API-Key": key}
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, proxy.url + path, json=body, headers=headers) as r,
    ):
        return r.status, await r.text()


@pytest.mark.parametrize(
    ("configured", "sent", "status"),
    [(KEY, None, 401), (KEY, WRONG, 403), (KEY, "", 403), (None, KEY, 403), (None, None, 403)],
)
async def test_key_matrix_refuses(configured, sent, status, caplog):
    caplog.set_level(logging.DEBUG)
    async with (
        admin_proxy(key=configured) as (proxy, _, _),
        running_sim(SimConfig(role="decode", model=MODEL)) as extra,
    ):
        for method, path, body in (
            ("POST", "/instances/add", {"type": "decode", "instance": f"127.0.0.1:{extra.port}"}),
            ("POST", "/instances/remove", {"instance": f"127.0.0.1:{extra.port}"}),
            ("GET", "/instances", None),
        ):
            got, text = await _admin(proxy, path, body, key=sent, method=method)
            assert got == status
            assert '"error"' in text and KEY not in text and WRONG not in text
            if configured is None:
                assert "ADMIN_API_KEY" in text
        assert len(proxy.state.registry) == 2
    assert KEY not in caplog.text and WRONG not in caplog.text


async def test_add_list_remove_with_right_key(caplog):
    caplog.set_level(logging.DEBUG)
    async with (
        admin_proxy() as (proxy, _, _),
        running_sim(SimConfig(role="decode", model=MODEL)) as extra,
    ):
        body = {"type": "decode", "instance": f"127.0.0.1:{extra.port}", "tp_size": 2}
        status, text = await _admin(proxy, "/instances/add", body)
        assert status == 200, text
        status, _ = await _admin(proxy, "/instances/add", body)
        assert status == 409
        status, text = await _admin(proxy, "/instances", method="GET")
        import orjson

        listed = orjson.loads(text)["instances"]
        added = next(i for i in listed if i["address"] == f"127.0.0.1:{extra.port}")
        assert added["source"] == "admin" and added["state"] == "ready" and added["tp_size"] == 2
        assert added["models"] == [MODEL]
        assert {i["role"] for i in listed} == {"prefill", "decode"}
        status, _ = await _admin(
            proxy, "/instances/remove", {"instance": f"127.0.0.1:{extra.port}"}
        )
        assert status == 200
        assert proxy.state.registry.get(extra.url) is None
        status, _ = await _admin(
            proxy, "/instances/remove", {"instance": f"127.0.0.1:{extra.port}"}
        )
        assert status == 404
    assert KEY not in caplog.text


@pytest.mark.parametrize(
    "body",
    [
        {"type": "decode", "instance": "no-port"},
        {"type": "decode", "instance": "127.0.0.1:0"},
        {"type": "decode", "instance": "127.0.0.1:70000"},
        {"type": "decode", "instance": "bad_host!:80"},
        {"type": "decode", "instance": "[::zz]:80"},
        {"type": "decode", "instance": 42},
        {"type": "both", "instance": "127.0.0.1:80"},
        {"type": "decode", "instance": "127.0.0.1:80", "dp_size": 0},
        {"type": "decode", "instance": "127.0.0.1:80", "transfer_mode": "PUSH"},
        # issue 19 row 12: these were 500s or accepted
        {"type": "decode", "instance": "127.0.0.1:\u00b2"},
        {"type": "decode", "instance": "127.0.0.1:\u0668\u0660"},
        {"type": ["decode"], "instance": "127.0.0.1:80"},
        {"type": "decode", "instance": "0.0.0.0:80"},
        {"type": "decode", "instance": "127.0.0.1:80", "zmq_address": "a:1\r\nX: y"},
        {"type": "decode", "instance": "127.0.0.1:80", "zmq_address": "a:1\u20ac"},
    ],
)
async def test_bad_address_is_400_and_changes_nothing(body):
    async with admin_proxy() as (proxy, _, _):
        status, text = await _admin(proxy, "/instances/add", body)
        assert status == 400, text
        assert len(proxy.state.registry) == 2


async def test_failed_probe_is_400():
    async with (
        admin_proxy() as (proxy, _, _),
        running_sim(SimConfig(role="decode", model="other")) as other,
    ):
        status, text = await _admin(
            proxy, "/instances/add", {"type": "decode", "instance": f"127.0.0.1:{other.port}"}
        )
        assert status == 400 and "other" in text
        dead = free_port()  # nothing listens there
        status, _ = await _admin(
            proxy, "/instances/add", {"type": "prefill", "instance": f"127.0.0.1:{dead}"}
        )
        assert status == 400
        assert len(proxy.state.registry) == 2


async def test_cidr_allow_list():
    async with (
        admin_proxy(cidrs=("10.0.0.0/8",)) as (proxy, _, _),
        running_sim(SimConfig(role="decode", model=MODEL)) as extra,
    ):
        status, text = await _admin(
            proxy, "/instances/add", {"type": "decode", "instance": f"localhost:{extra.port}"}
        )
        assert status == 403 and "allowed networks" in text
    async with (
        admin_proxy(cidrs=("127.0.0.0/8",)) as (proxy, _, _),
        running_sim(SimConfig(role="decode", model=MODEL)) as extra,
    ):
        status, _ = await _admin(
            proxy, "/instances/add", {"type": "decode", "instance": f"127.0.0.1:{extra.port}"}
        )
        assert status == 200


async def test_remove_while_busy_drains():
    async with admin_proxy(n_decode=2, decode_tps=25) as (proxy, _, (d0, d1)):
        body = {"model": MODEL, "prompt": "drain me slowly", "max_tokens": 15, "stream": True}
        async with aiohttp.ClientSession() as s:
            busy = await s.post(proxy.url + "/v1/completions", json=body)
            await busy.content.readuntil(b"\n\n")
            busy_sim = d0 if d0.generation_requests() else d1
            idle_sim = d1 if busy_sim is d0 else d0
            status, text = await _admin(
                proxy, "/instances/remove", {"instance": f"127.0.0.1:{busy_sim.port}"}
            )
            assert status == 200 and '"draining"' in text
            entry = proxy.state.registry.get(busy_sim.url)
            assert entry is not None and entry.legs.in_flight == 1
            for _ in range(3):  # new requests avoid the draining decode
                async with s.post(
                    proxy.url + "/v1/completions", json={**body, "max_tokens": 2}
                ) as r:
                    assert r.status == 200
                    await r.read()
            assert (
                len(busy_sim.generation_requests()) == 1
                and len(idle_sim.generation_requests()) == 3
            )
            rest = await busy.read()  # the in-flight stream finishes whole
            assert rest.rstrip().endswith(b"data: [DONE]") and b'"error"' not in rest
            busy.close()
        for _ in range(100):
            if proxy.state.registry.get(busy_sim.url) is None:
                break
            await asyncio.sleep(0.02)
        assert proxy.state.registry.get(busy_sim.url) is None


async def test_own_address_and_aliases_refused():
    """Issue 19 rows 4 and 12: pdproxy's own address was accepted (a routing loop), and
    localhost:P beside 127.0.0.1:P was a second instance."""
    async with (
        admin_proxy() as (proxy, p, _),
        running_sim(SimConfig(role="decode", model=MODEL)) as extra,
    ):
        own = proxy.url.rsplit(":", 1)[1]
        for instance in (f"127.0.0.1:{own}", f"localhost:{own}", f"[::1]:{own}"):
            status, text = await _admin(
                proxy, "/instances/add", {"type": "decode", "instance": instance}
            )
            assert status == 400 and "own listener" in text
        status, text = await _admin(
            proxy, "/instances/add", {"type": "prefill", "instance": f"localhost:{p.port}"}
        )
        assert status == 409 and "another name" in text
        body = {"type": "decode", "instance": f"localhost:{extra.port}"}
        assert (await _admin(proxy, "/instances/add", body))[0] == 200
        for alias in (f"127.0.0.1:{extra.port}", f"[::1]:{extra.port}"):
            status, _ = await _admin(proxy, "/instances/add", {**body, "instance": alias})
            assert status == 409
        assert len(proxy.state.registry) == 3
