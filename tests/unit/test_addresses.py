"""Instance addresses (issue 19, items 4 and 7): canonical spellings, ASCII ports, unroutable
hosts, KV addresses fit for a header; pdproxy's own listener; the hop marker."""

from __future__ import annotations

import ipaddress
import socket
import struct

import pytest

from pdproxy.config.addresses import (
    LOOPBACK,
    identity,
    kv_address_problem,
    listener_hosts,
    parse_engine_url,
    parse_host_port,
)
from pdproxy.errors import ConfigError
from pdproxy.membership.guard import InstanceGuard, OwnListener
from pdproxy.wire.hop import Hop


@pytest.mark.parametrize(
    ("text", "host"),
    [
        ("127.0.0.1:80", "127.0.0.1"),
        ("LOCALHOST:80", "localhost"),
        ("Engine-1.SVC:80", "engine-1.svc"),
        ("[0:0:0:0:0:0:0:1]:80", "::1"),
        ("[::FFFF:127.0.0.1]:80", "127.0.0.1"),  # IPv4-mapped: its IPv4
        ("127.1:80", "127.0.0.1"),  # the resolver's legacy numeric forms
        ("2130706433:80", "127.0.0.1"),
        ("0x7f.0.0.1:80", "127.0.0.1"),
        ("0177.0.0.1:80", "127.0.0.1"),
        ("fd00::2:21001", "fd00::2"),  # P2P-NCCL's unbracketed IPv6 zmq_address
        ("h:080", "h"),
    ],
)
def test_literal_spellings_are_written_one_way(text, host):
    assert parse_host_port(text)[0] == host


@pytest.mark.parametrize(
    "text",
    [
        "127.0.0.1:\u00b2",  # superscript two: str.isdigit() says yes, int() says no
        "127.0.0.1:\u0668\u0660\u0660\u0660",  # Arabic-Indic 8000: int() reads it
        "127.0.0.1:\uff18\uff10",  # fullwidth 80
        "h:000080",
        "0.0.0.0:80",  # unroutable
        "[::]:80",
        "0:80",
        "224.0.0.1:80",
        "255.255.255.255:80",
        "h\n:80",  # a regex's $ matches before a trailing line break
        "caf\u00e9:80",
        "[127.0.0.1]:80",
        "h:",
        ":80",
    ],
)
def test_refused_everywhere(text):
    with pytest.raises(ConfigError):
        parse_host_port(text)
    with pytest.raises(ConfigError):
        parse_engine_url(text)


def test_loopback_spellings_are_one_identity():
    spellings = ["127.0.0.1:9", "localhost:9", "a.localhost:9", "[::1]:9", "127.0.0.2:9", "127.1:9"]
    assert {identity(*parse_host_port(s)) for s in spellings} == {f"{LOOPBACK} 9"}
    assert identity(*parse_host_port("localhost:10")) != identity(*parse_host_port("[::1]:9"))


@pytest.mark.parametrize(
    "text",
    ["127.0.0.1:5", "fd00::2:21001", "node-3:5", "host:10.0.0.1,handshake:6301,notify:61005"],
)
def test_kv_addresses_accepted(text):
    assert kv_address_problem(text) is None


@pytest.mark.parametrize(
    "text",
    [
        "127.0.0.1:5\r\nX-Injected: 1",
        "127.0.0.1:5\n",
        "caf\u00e9:5",  # Latin-1, still not ASCII
        "\u20ac:5",  # not Latin-1: made every request through the instance a 500
        "h\x00:5",
        "h\t:5",
        "a b:5",
        "",
        "h:5" + "0" * 600,
        "host:10.0.0.1,handshake:99999,notify:1",
        "host:\u00e9,handshake:1,notify:2",
        "tcp://h:5",
    ],
)
def test_kv_addresses_refused(text):
    assert kv_address_problem(text) is not None


def test_listener_hosts_without_io():
    assert listener_hosts("0.0.0.0") == {LOOPBACK}
    assert listener_hosts("127.0.0.1") == {LOOPBACK}
    assert listener_hosts("10.0.0.7") == {"10.0.0.7"}


def test_own_listener_everywhere_knows_the_hosts_addresses():
    own = OwnListener.discover("0.0.0.0", 8000)
    assert own.is_self("127.0.0.1", 8000) and own.is_self("::1", 8000)
    assert own.is_self("localhost", 8000) and not own.is_self("127.0.0.1", 8001)
    assert own.is_self(socket.gethostname().lower(), 8000)


def test_own_listener_everywhere_knows_every_interface_address():
    """Checked against the kernel's other answer: SIOCGIFADDR per interface."""
    fcntl = pytest.importorskip("fcntl")
    own = OwnListener.discover("0.0.0.0", 8000)
    seen = 0
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            try:
                packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
        address = socket.inet_ntoa(packed[20:24])
        assert own.is_self(address, 8000), (name, address)
        seen += 1
    assert seen >= 1  # the loopback at least


def test_own_listener_on_one_address():
    own = OwnListener(8000, {"10.0.0.7"})
    assert own.is_self("10.0.0.7", 8000)
    assert not own.is_self("10.0.0.8", 8000) and not own.is_self("127.0.0.1", 8000)
    own.listening(9000)  # --port 0, once bound
    assert own.is_self("10.0.0.7", 9000) and not own.is_self("10.0.0.7", 8000)


def test_guard_refuses_itself_and_aliases_of_known_instances():
    known: dict[str, object] = {}
    guard = InstanceGuard(OwnListener(8000, {LOOPBACK, "10.0.0.7"}), known.get)
    for url in ("http://127.0.0.1:8000", "http://localhost:8000", "http://10.0.0.7:8000"):
        refusal = guard.check(url)
        assert refusal is not None and refusal.status == 400 and "own listener" in refusal.reason
    assert guard.check("http://127.0.0.1:9") is None
    known["http://127.0.0.1:9"] = object()
    guard.admitted("http://127.0.0.1:9")
    for alias in ("http://localhost:9", "https://[::1]:9", "http://127.0.0.2:9"):
        refusal = guard.check(alias)
        assert refusal is not None and refusal.status == 409 and "127.0.0.1:9" in refusal.reason
    assert guard.check("http://127.0.0.1:9") is None  # itself: a re-announcement
    assert guard.known_as("http://localhost:9") == "http://127.0.0.1:9"
    del known["http://127.0.0.1:9"]  # left the registry: the alias is free again
    assert guard.check("http://localhost:9") is None
    guard.forgot("http://127.0.0.1:9")
    assert guard.known_as("http://localhost:9") is None


async def test_guard_resolves_names_only_when_asked():
    name = socket.gethostname().lower()
    if not ipaddress.ip_address(socket.gethostbyname(name)).is_loopback:
        pytest.skip("this host's name does not resolve to a loopback address")
    known: dict[str, object] = {"http://127.0.0.1:9": object()}
    guard = InstanceGuard(OwnListener(8000, {LOOPBACK}), known.get)  # its name unknown
    guard.admitted("http://127.0.0.1:9")
    assert guard.check(f"http://{name}:8000") is None  # a heartbeat never resolves
    refusal, _ = await guard.check_resolved(f"http://{name}:8000", 2.0)
    assert refusal is not None and refusal.status == 400
    refusal, _ = await guard.check_resolved(f"http://{name}:9", 2.0)
    assert refusal is not None and refusal.status == 409
    refusal, also = await guard.check_resolved(f"http://{name}:10", 2.0)
    assert refusal is None and also == (f"{LOOPBACK} 10",)
    refusal, _ = await guard.check_resolved("http://no-such-host.invalid:9", 2.0)
    assert refusal is not None and refusal.status == 400 and "resolve" in refusal.reason


def test_hop_marker():
    hop = Hop.of("0123abcd")
    assert hop.via == "1.1 pdproxy-0123abcd"
    assert hop.forward(None) == hop.via
    assert hop.forward("1.1 pdproxy-ffff") == "1.1 pdproxy-ffff, 1.1 pdproxy-0123abcd"
    assert hop.returned("1.0 lb, 1.1 pdproxy-0123abcd")
    assert not hop.returned("1.1 pdproxy-0123abce") and not hop.returned(None)
