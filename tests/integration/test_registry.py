"""The ZMQ registry with real DEALER sockets sending vLLM's exact payloads."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from engines.ports import free_port
from engines.sim import SimConfig, running_sim
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.registry import RegistryConfig
from pdproxy.types import EndpointState
from tests.integration.conftest import MODEL
from tests.servers import running_proxy

TTL, SWEEP = 0.6, 0.1


@contextlib.asynccontextmanager
async def registry_proxy(**overrides):
    port = free_port()
    config = ProxyConfig(
        registry=RegistryConfig(port=port, host="127.0.0.1", ttl=TTL, sweep_interval=SWEEP),
        **overrides,
    )
    async with running_proxy(config) as proxy:
        yield proxy, f"tcp://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def dealer(endpoint: str, identity: bytes | None = None):
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close(0)
        ctx.term()


def p2p(kind: str, sim) -> bytes:
    return msgpack.dumps(
        {
            "type": kind,
            "http_address": f"127.0.0.1:{sim.port}",
            "zmq_address": f"127.0.0.1:{sim.kv_port}",
        }
    )


def moriio(kind: str, sim, mode="READ") -> bytes:
    return msgpack.dumps(
        {
            "type": kind,
            "http_address": f"127.0.0.1:{sim.port}",
            "zmq_address": f"host:127.0.0.1,handshake:{sim.kv_port},notify:{sim.kv_port}",
            "dp_size": 1,
            "tp_size": 1,
            "transfer_mode": mode,
        }
    )


async def _until(predicate, timeout=3.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


async def _complete(url: str):
    body = {"model": MODEL, "prompt": "registry test prompt", "max_tokens": 4}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.json()


async def test_empty_proxy_answers_503_until_registered_then_expires():
    async with (
        registry_proxy() as (proxy, endpoint),
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        running_sim(SimConfig(role="decode", model=MODEL)) as d,
        dealer(endpoint) as sock_p,
        dealer(endpoint) as sock_d,
    ):
        status, body = await _complete(proxy.url)
        assert status == 503 and body["error"]["type"] == "ServiceUnavailableError"
        registry = proxy.state.registry
        for _ in range(2):  # a register is also a heartbeat: idempotent
            await sock_p.send(p2p("P", p))
            await sock_d.send(p2p("D", d))
        await _until(
            lambda: len(registry.snapshot().prefill) == 1 and len(registry.snapshot().decode) == 1
        )
        assert len(registry) == 2
        status, body = await _complete(proxy.url)
        assert status == 200 and body["choices"][0]["text"]
        (entry,) = registry.snapshot().prefill
        assert (
            entry.address.zmq_address == f"127.0.0.1:{p.kv_port}"
            and entry.presence.last_seen is not None
        )
        # heartbeats keep it alive past the TTL
        for _ in range(4):
            await asyncio.sleep(TTL / 3)
            await sock_p.send(p2p("P", p))
            await sock_d.send(p2p("D", d))
        assert len(registry) == 2
        stopped = time.monotonic()
        gone = await _until(lambda: len(registry) == 0, timeout=TTL + 1)
        assert gone - stopped <= TTL + SWEEP + 0.15
        status, _ = await _complete(proxy.url)
        assert status == 503


async def test_garbage_flood_leaves_proxy_serving(caplog):
    caplog.set_level(logging.WARNING, logger="pdproxy")
    async with (
        registry_proxy() as (proxy, endpoint),
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        running_sim(SimConfig(role="decode", model=MODEL)) as d,
        dealer(endpoint) as sock,
        dealer(endpoint) as attacker,
        dealer(endpoint) as oversized,
    ):
        garbage = [
            b"\xc1\xc1",
            b"",
            msgpack.dumps([1]),
            msgpack.dumps({"type": "nope"}),
            b"y" * 1000,
        ]
        for i in range(2000):
            await attacker.send(garbage[i % len(garbage)])
        await attacker.send_multipart([b"a", b"b", b"c"])
        await oversized.send(b"x" * 200_000)  # past MAXMSGSIZE: libzmq drops that peer
        await sock.send(msgpack.dumps({"type": "HELLO"}))
        await sock.send(p2p("P", p))
        await sock.send(p2p("D", d))
        registry = proxy.state.registry
        await _until(lambda: len(registry.snapshot().decode) == 1, timeout=5)
        status, _ = await _complete(proxy.url)
        assert status == 200
        metrics = proxy.state.metrics.registry_messages
        assert metrics.labels("malformed")._value.get() >= 1000
        assert metrics.labels("ignored")._value.get() == 1
        warnings = [r for r in caplog.records if "registry" in r.getMessage()]
        assert 1 <= len(warnings) <= 5  # rate-limited, not one line per bad frame


async def test_transfer_mode_mismatch_is_refused():
    async with (
        registry_proxy(kv_connector="moriio") as (proxy, endpoint),
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        running_sim(SimConfig(role="decode", model=MODEL)) as d,
        dealer(endpoint) as sock,
    ):
        await sock.send(moriio("P", p, "READ"))
        registry = proxy.state.registry
        await _until(lambda: len(registry) == 1)
        await sock.send(moriio("D", d, "WRITE"))
        await _until(
            lambda: proxy.state.metrics.registry_messages.labels("refused")._value.get() == 1
        )
        assert len(registry) == 1 and proxy.state.membership.transfer_mode == "READ"


async def test_fixed_transfer_mode_refuses_first_registration_too():
    async with (
        registry_proxy(kv_connector="moriio", transfer_mode="WRITE") as (proxy, endpoint),
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        dealer(endpoint) as sock,
    ):
        await sock.send(moriio("P", p, "READ"))
        await _until(
            lambda: proxy.state.metrics.registry_messages.labels("refused")._value.get() == 1
        )
        assert len(proxy.state.registry) == 0


async def test_model_mismatch_is_refused_and_match_needs_probe():
    async with (
        registry_proxy(model=MODEL) as (proxy, endpoint),
        running_sim(SimConfig(role="prefill", model=MODEL)) as good,
        running_sim(SimConfig(role="decode", model="other-model")) as bad,
        dealer(endpoint) as sock,
    ):
        registry = proxy.state.registry
        await sock.send(p2p("P", good))
        await sock.send(p2p("D", bad))
        await _until(lambda: len(registry.snapshot().prefill) == 1)
        (entry,) = registry.snapshot().prefill
        assert entry.models == (MODEL,) and entry.state is EndpointState.READY
        assert any(r.path == "/v1/models" for r in good.requests)
        await _until(
            lambda: (
                registry.get(bad.url) is None and any(r.path == "/v1/models" for r in bad.requests)
            )
        )
        await asyncio.sleep(0.1)
        assert registry.snapshot().decode == ()


async def test_legacy_moriio_registration_routes():
    async with (
        registry_proxy(kv_connector="moriio") as (proxy, endpoint),
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        dealer(endpoint) as sock,
    ):
        await sock.send(msgpack.dumps({"type": "HELLO"}))
        await sock.send(
            msgpack.dumps(
                {
                    "type": "register",
                    "role": "P",
                    "request_address": f"http://127.0.0.1:{p.port}/v1/completions",
                    "handshake_port": 6301,
                    "notify_port": 61005,
                    "dp_size": 2,
                    "tp_size": 1,
                    "transfer_mode": "WRITE",
                }
            )
        )
        registry = proxy.state.registry
        await _until(lambda: len(registry.snapshot().prefill) == 1)
        (entry,) = registry.snapshot().prefill
        assert entry.address.zmq_address == "host:127.0.0.1,handshake:6301,notify:61005"
        assert entry.dp_size == 2 and proxy.state.membership.transfer_mode == "WRITE"


@pytest.mark.parametrize("ttl", [0.3])
async def test_static_instances_never_expire(ttl):
    async with (
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        running_sim(SimConfig(role="decode", model=MODEL)) as d,
    ):
        from pdproxy.types import EngineAddress

        config = ProxyConfig(
            prefill=(EngineAddress(url=p.url),),
            decode=(EngineAddress(url=d.url),),
            registry=RegistryConfig(
                port=free_port(), host="127.0.0.1", ttl=ttl, sweep_interval=0.05
            ),
        )
        async with running_proxy(config) as proxy:
            await asyncio.sleep(ttl * 3)
            assert len(proxy.state.registry.snapshot().prefill) == 1
            status, _ = await _complete(proxy.url)
            assert status == 200


async def test_restarted_engine_with_same_identity_is_heard():
    """P2P-NCCL engines use their zmq_address as socket identity; a restart reuses it."""
    async with (
        registry_proxy() as (proxy, endpoint),
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        dealer(endpoint, identity=b"127.0.0.1:21001") as old,
    ):
        await old.send(p2p("P", p))
        registry = proxy.state.registry
        await _until(lambda: len(registry) == 1)
        # the old connection is still open (a crashed host sends no FIN) when the new one comes
        async with dealer(endpoint, identity=b"127.0.0.1:21001") as new:
            await asyncio.sleep(0.1)
            before = proxy.state.metrics.registry_messages.labels("accepted")._value.get()
            await new.send(p2p("P", p))
            await _until(
                lambda: (
                    proxy.state.metrics.registry_messages.labels("accepted")._value.get() > before
                )
            )


# -- robustness: no message stops the registry (issue item 0) ---------------------------

_FIELDS = ("type", "role", "http_address", "zmq_address", "dp_size", "tp_size")
_FIELDS += ("transfer_mode", "request_address", "handshake_port", "notify_port")
_NEAR_MISSES = ("P", "D", "HELLO", "register", "READ", "", "h:1", "h:\u00b2", "http://h:0/")


def _value(rng: random.Random, depth: int = 0) -> object:
    """A random msgpack-able structure: every scalar type, nested lists and maps."""
    kind = rng.randrange(10 if depth < 3 else 8)
    scalars = (
        None,
        rng.random() < 0.5,
        rng.randint(-(2**63), 2**64 - 1),
        rng.uniform(-1e300, 1e300),
        "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(rng.randrange(8))),
        rng.randbytes(rng.randrange(8)),
        rng.choice(_NEAR_MISSES),
        msgpack.ExtType(rng.randrange(128), rng.randbytes(rng.randrange(4))),
    )
    if kind < len(scalars):
        return scalars[kind]
    if kind == 8:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = (rng.choice(_FIELDS), rng.randrange(100), rng.randbytes(3), None)
    return {rng.choice(keys): _value(rng, depth + 1) for _ in range(rng.randrange(4))}


def _malformed(rng: random.Random) -> list[bytes]:
    """The frames of one message that must be refused, built so by construction."""
    kind = rng.randrange(6)
    if kind == 0:
        return [b""]
    if kind == 1:  # arrives with 3-5 frames counting the identity
        return [rng.randbytes(rng.randrange(1, 16)) for _ in range(rng.randint(2, 4))]
    if kind == 2:  # raw bytes that do not start a msgpack map
        first = rng.choice(
            [b for b in range(256) if not 0x80 <= b <= 0x8F and b not in (0xDE, 0xDF)]
        )
        return [bytes([first]) + rng.randbytes(rng.randrange(64))]
    if kind == 3:
        return [msgpack.dumps([_value(rng)])]  # not a map
    message = {rng.choice(_FIELDS): _value(rng) for _ in range(rng.randrange(6))}
    if kind == 4:  # a type that is not one of the four, any other field
        message["type"] = rng.choice((["P"], {"P": 1}, b"P", 1, None, "p", "HELLO "))
    else:  # a registration whose address field is broken
        message["type"] = rng.choice(("P", "D", "register"))
        message["http_address" if message["type"] != "register" else "request_address"] = (
            rng.choice(("nohost", "h:99999", "h:\u00b2", "", ["h:1"], 7, "http://[::1/"))
        )
    return [msgpack.dumps(message)]


async def test_thousands_of_generated_malformed_messages_then_a_valid_one(caplog):
    """Regression for issue item 0: ``{"type": ["P"]}`` killed the serve loop silently."""
    caplog.set_level(logging.WARNING, logger="pdproxy")
    rng = random.Random(20240601)
    messages = [_malformed(rng) for _ in range(3000)]
    async with (
        registry_proxy() as (proxy, endpoint),
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        dealer(endpoint) as sock,
        dealer(endpoint) as oversized,
    ):
        counter = proxy.state.metrics.registry_messages
        before = counter.labels("malformed")._value.get()
        await oversized.send(b"x" * (64 * 1024 + 1))  # past MAXMSGSIZE: libzmq drops the peer
        for frames in messages:
            await sock.send_multipart(frames)
        await sock.send(p2p("P", p))
        registry = proxy.state.registry
        await _until(lambda: registry.get(p.url) is not None, timeout=10)
        assert counter.labels("malformed")._value.get() - before == len(messages)
        assert counter.labels("error")._value.get() == 0
        warnings = [r for r in caplog.records if "registry" in r.getMessage()]
        assert 1 <= len(warnings) <= 5  # rate-limited, not one line per bad message


def _fail_once(method):
    calls = []

    def wrapper(*args):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("injected failure")
        return method(*args)

    return wrapper


async def test_heartbeat_exception_is_logged_and_next_message_is_served(caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="pdproxy")
    async with (
        registry_proxy() as (proxy, endpoint),
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        dealer(endpoint) as sock,
    ):
        membership = proxy.state.membership
        monkeypatch.setattr(membership, "heartbeat", _fail_once(membership.heartbeat))
        await sock.send(p2p("P", p))
        await sock.send(p2p("P", p))
        await _until(lambda: proxy.state.registry.get(p.url) is not None)
        assert proxy.state.metrics.registry_messages.labels("error")._value.get() == 1
        (failure,) = [r for r in caplog.records if r.exc_info]
        assert "injected failure" in str(failure.exc_info[1])


async def test_serve_loop_survives_an_escaping_exception_and_stops_promptly(caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="pdproxy")
    async with (
        registry_proxy() as (proxy, endpoint),
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        dealer(endpoint) as sock,
    ):
        zmq_registry = proxy.state.control.zmq
        monkeypatch.setattr(zmq_registry, "_handle", _fail_once(zmq_registry._handle))
        errors = proxy.state.metrics.registry_messages.labels("error")
        await sock.send(p2p("P", p))  # lost: _handle raises past its own guards
        await sock.send(p2p("P", p))  # served after the 0.1 s backoff
        await _until(lambda: proxy.state.registry.get(p.url) is not None)
        assert errors._value.get() == 1
        (failure,) = [r for r in caplog.records if r.exc_info]
        assert "receive loop failed" in failure.getMessage()
        # now fail every message: the backoff doubles (0.1, 0.2, 0.4, 0.8 s) ...
        monkeypatch.setattr(zmq_registry, "_handle", _always_raise)
        for _ in range(5):
            await sock.send(p2p("P", p))
        await _until(lambda: errors._value.get() == 6, timeout=5)
        stopping = time.monotonic()
    # ... and shutdown cancels the 1.6 s sleep at once
    assert time.monotonic() - stopping < 1.0


def _always_raise(frames):
    raise RuntimeError("injected failure")
