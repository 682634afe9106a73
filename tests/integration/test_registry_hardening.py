"""The registry's allow-list (ZAP) and the muting of peers that send garbage too fast."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgpack
import pytest

from engines.ports import free_port
from engines.sim import SimConfig, running_sim
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.registry import RegistryConfig
from pdproxy.membership.discovery.zap import allowed, parse_networks
from pdproxy.membership.discovery.zmq import GarbageLimiter
from tests.integration.conftest import MODEL
from tests.integration.test_registry import dealer, p2p
from tests.servers import RunningProxy, running_proxy


@contextlib.asynccontextmanager
async def guarded_proxy(
    allow_cidrs: tuple[str, ...] = (),
) -> AsyncIterator[tuple[RunningProxy, str]]:
    port = free_port()
    registry = RegistryConfig(port=port, host="127.0.0.1", allow_cidrs=allow_cidrs)
    async with running_proxy(ProxyConfig(registry=registry)) as proxy:
        yield proxy, f"tcp://127.0.0.1:{port}"


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def value(counter: Any, *labels: str) -> float:
    return float((counter.labels(*labels) if labels else counter)._value.get())


# -- the allow-list ----------------------------------------------------------------------


async def test_peer_outside_the_allow_list_is_refused_at_the_handshake(caplog):
    caplog.set_level(logging.WARNING, logger="pdproxy")
    async with (
        guarded_proxy(allow_cidrs=("10.0.0.0/8",)) as (proxy, endpoint),
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        dealer(endpoint) as sock,
    ):
        metrics = proxy.state.metrics
        for _ in range(3):
            await sock.send(p2p("P", p))
        await until(lambda: value(metrics.registry_refused) >= 1)
        await asyncio.sleep(0.3)  # time enough for a message to arrive, were it let in
        assert len(proxy.state.registry) == 0
        (family,) = metrics.registry_messages.collect()
        assert not [s for s in family.samples if s.name.endswith("_total")]  # none counted
        (line,) = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert "127.0.0.1" in line and "--registry-allow-cidr" in line


async def test_peer_inside_the_allow_list_registers():
    allow = ("10.0.0.0/8", "::1/128", "127.0.0.0/8")
    async with (
        guarded_proxy(allow_cidrs=allow) as (proxy, endpoint),
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        dealer(endpoint) as sock,
    ):
        await sock.send(p2p("P", p))
        await until(lambda: proxy.state.registry.get(p.url) is not None)
        assert value(proxy.state.metrics.registry_refused) == 0


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("127.0.0.1", True),
        ("10.1.2.3", True),
        ("::ffff:10.1.2.3", True),  # an IPv4 peer of a dual-stack socket
        ("::1", True),
        ("192.168.0.1", False),
        ("::2", False),
        ("", False),
        ("not an address", False),
    ],
)
def test_allowed_matches_ipv4_ipv6_and_mapped_addresses(address, expected):
    networks = parse_networks(("10.0.0.0/8", "127.0.0.1/8", "::1/128"))
    assert networks[1] == ipaddress.ip_network("127.0.0.0/8")  # host bits ignored
    assert allowed(address, networks) is expected


# -- muting peers that send garbage too fast ----------------------------------------------


async def test_a_garbage_flooding_peer_is_muted_and_a_valid_engine_is_not(caplog):
    caplog.set_level(logging.WARNING, logger="pdproxy")
    # 51 units each: 98 of them leave 2 of a fresh bucket's 5,000, the 99th mutes the peer
    big = b"\xc1" * (50 * 1024)
    async with (
        guarded_proxy() as (proxy, endpoint),
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        running_sim(SimConfig(role="decode", model=MODEL)) as d,
        dealer(endpoint) as attacker,
        dealer(endpoint) as engine,
    ):
        metrics = proxy.state.metrics
        for _ in range(100):
            await attacker.send(big)
        await attacker.send(p2p("P", p))  # valid, but from a muted peer: dropped unread
        await until(lambda: value(metrics.registry_messages, "muted") == 2)
        assert value(metrics.registry_messages, "malformed") == 99
        assert value(metrics.registry_mutes) == 1
        # the engine beside it, on the same host, is heard
        await engine.send(p2p("D", d))
        await until(lambda: proxy.state.registry.get(d.url) is not None)
        assert proxy.state.registry.get(p.url) is None
        (line,) = [r.getMessage() for r in caplog.records if "muted" in r.getMessage()]
        assert "for 10 s" in line


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_limiter_allows_a_burst_then_the_rate_and_mutes_past_it():
    clock = FakeClock()
    limiter = GarbageLimiter(clock, rate=50, burst=1000, mute_for=10)
    assert not any(limiter.strike(b"a", 1) for _ in range(1000))
    clock.now += 0.5  # 25 units more
    assert not any(limiter.strike(b"a", 1) for _ in range(25))
    assert limiter.strike(b"a", 1) and limiter.muted(b"a")
    assert not limiter.muted(b"b")
    clock.now += 9.5
    assert limiter.muted(b"a")
    clock.now += 0.5
    assert not limiter.muted(b"a")
    # back from a mute with an empty bucket: what 10 s of refill gave, 500 units
    assert not limiter.strike(b"a", 500)
    assert limiter.strike(b"a", 1)


def test_limiter_weights_large_garbage():
    limiter = GarbageLimiter(FakeClock(), rate=50, burst=100)
    assert not limiter.strike(b"a", 65)
    assert limiter.strike(b"a", 65)


def test_limiter_tables_are_capped_and_forget_stale_peers():
    clock = FakeClock()
    limiter = GarbageLimiter(clock, rate=50, burst=100, mute_for=10, max_peers=64)
    for i in range(10_000):
        limiter.strike(i.to_bytes(4, "big"), 1)
    assert len(limiter) == 64
    for i in range(10_000):
        limiter.strike(i.to_bytes(4, "big"), 101)
    assert len(limiter) == 128
    # once full again (2 s) a bucket is forgotten, once over a mute is dropped
    clock.now += 10
    limiter.strike(b"new", 101)
    assert len(limiter) == 2


# -- issue 19: pdproxy's own address, strings that go into headers ------------------------


async def test_own_address_and_unsendable_zmq_address_refused(caplog):
    caplog.set_level(logging.WARNING, logger="pdproxy")
    async with (
        guarded_proxy() as (proxy, endpoint),
        running_sim(SimConfig(role="prefill", model=MODEL)) as p,
        dealer(endpoint) as sock,
    ):
        metrics = proxy.state.metrics
        own = proxy.url.rsplit(":", 1)[1]
        for host in ("127.0.0.1", "localhost", "[::1]"):
            await sock.send(
                msgpack.dumps({"type": "D", "http_address": f"{host}:{own}", "zmq_address": "h:1"})
            )
        await until(lambda: value(metrics.registry_messages, "refused") >= 3)
        for zmq_address in ("h:1\r\nX-Injected: 1", "h:1\u20ac"):
            message = {
                "type": "P",
                "http_address": f"127.0.0.1:{p.port}",
                "zmq_address": zmq_address,
            }
            await sock.send(msgpack.dumps(message))
        await until(lambda: value(metrics.registry_messages, "malformed") >= 2)
        assert len(proxy.state.registry) == 0
    assert "own listener" in caplog.text
