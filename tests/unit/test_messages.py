from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.config.addresses import header_safe
from pdproxy.errors import RegistryMessageError
from pdproxy.membership.discovery.messages import decode
from pdproxy.types import Role

MAX = 64 * 1024


def _enc(d):
    return msgpack.dumps(d)


def test_p2p_payload():
    reg = decode(
        _enc({"type": "P", "http_address": "10.0.0.1:20003", "zmq_address": "10.0.0.1:21001"}), MAX
    )
    assert reg.role is Role.PREFILL and reg.format == "p2p"
    assert reg.address.url == "http://10.0.0.1:20003"
    assert reg.address.zmq_address == "10.0.0.1:21001"
    assert reg.address.transfer_mode is None and reg.address.dp_size == 1


def test_moriio_payload():
    payload = {
        "type": "D",
        "http_address": "10.0.0.2:8200",
        "zmq_address": "host:10.0.0.2,handshake:6301,notify:61005",
        "dp_size": 2,
        "tp_size": 8,
        "transfer_mode": "WRITE",
    }
    reg = decode(_enc(payload), MAX)
    assert reg.role is Role.DECODE and reg.format == "moriio"
    assert (reg.address.dp_size, reg.address.tp_size, reg.address.transfer_mode) == (2, 8, "WRITE")
    assert reg.address.zmq_address == payload["zmq_address"]


def test_moriio_legacy_payload():
    payload = {
        "type": "register",
        "role": "P",
        "request_address": "http://10.0.0.3:8100/v1/completions",
        "handshake_port": 6301,
        "notify_port": "61005",
        "dp_size": 1,
        "tp_size": 1,
        "transfer_mode": "read",
    }
    reg = decode(_enc(payload), MAX)
    assert reg.role is Role.PREFILL and reg.format == "moriio-legacy"
    assert reg.address.url == "http://10.0.0.3:8100"
    assert reg.address.zmq_address == "host:10.0.0.3,handshake:6301,notify:61005"
    assert reg.address.transfer_mode == "READ"


def test_hello_is_ignored():
    assert decode(_enc({"type": "HELLO"}), MAX) is None


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1garbage",
        b"",
        _enc([1, 2, 3]),
        _enc({"type": "X"}),
        _enc({"type": "P"}),
        _enc({"type": "P", "http_address": "nohost", "zmq_address": "a:1"}),
        _enc({"type": "P", "http_address": "h:99999", "zmq_address": "a:1"}),
        _enc({"type": "P", "http_address": "h:1", "zmq_address": ""}),
        _enc(
            {
                "type": "P",
                "http_address": "h:1",
                "zmq_address": "z",
                "dp_size": 0,
                "tp_size": 1,
                "transfer_mode": "READ",
            }
        ),
        _enc(
            {
                "type": "P",
                "http_address": "h:1",
                "zmq_address": "z",
                "dp_size": True,
                "tp_size": 1,
                "transfer_mode": "READ",
            }
        ),
        _enc(
            {
                "type": "D",
                "http_address": "h:1",
                "zmq_address": "z",
                "dp_size": 1,
                "tp_size": 1,
                "transfer_mode": "PUSH",
            }
        ),
        _enc({"type": "register", "role": "X", "request_address": "http://h:1/v1"}),
        _enc(
            {
                "type": "register",
                "role": "P",
                "request_address": "h:1",
                "handshake_port": 1,
                "notify_port": 2,
                "transfer_mode": "READ",
            }
        ),
        _enc(
            {
                "type": "register",
                "role": "P",
                "request_address": "http://h:1/",
                "handshake_port": 0,
                "notify_port": 2,
                "transfer_mode": "READ",
            }
        ),
        _enc({1: 2}),
    ],
)
def test_malformed_messages_raise(payload):
    with pytest.raises(RegistryMessageError):
        decode(payload, MAX)


def test_oversized_message_raises():
    big = _enc({"type": "P", "http_address": "h:1", "zmq_address": "x" * 100})
    with pytest.raises(RegistryMessageError):
        decode(big, 64)


# -- robustness: decode() raises RegistryMessageError and nothing else -------------------

_FIELDS = (
    "type",
    "role",
    "http_address",
    "zmq_address",
    "dp_size",
    "tp_size",
    "transfer_mode",
    "request_address",
    "handshake_port",
    "notify_port",
)
_NEAR_MISSES = (
    *("P", "D", "HELLO", "register", "READ", "write", "", "x" * 600, "²", "٨٠", "9" * 5000),
    *("h:1", "127.0.0.1:8000", "[::1]:80", "[::1:80", "h:99999", "h:²", "h:", ":1"),
    *("http://h:1/v1", "http://h:99999/", "http://[::1/", "http://h:x/", "ftp://h:1/"),
)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),  # msgpack's whole int range
    st.floats(),
    st.text(max_size=12),
    st.binary(max_size=12),
    st.sampled_from(_NEAR_MISSES),
    st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=12)),
    st.builds(msgpack.Timestamp, st.integers(0, 2**34 - 1), st.integers(0, 999_999_999)),
)
_keys = st.one_of(
    st.sampled_from(_FIELDS),
    st.text(max_size=6),
    st.binary(max_size=6),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False),
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_keys, inner, max_size=4)),
    max_leaves=8,
)
_field = st.one_of(  # one level of nesting is enough to reach every type check
    st.sampled_from(_NEAR_MISSES),
    _scalars,
    st.lists(_scalars, max_size=3),
    st.dictionaries(_keys, _scalars, max_size=3),
)
_registration_shaped = st.fixed_dictionaries(
    {"type": st.one_of(st.sampled_from(("P", "D", "register", "HELLO")), _field)},
    optional={name: _field for name in _FIELDS[1:]},
)


def _fuzz(examples: int) -> settings:
    """Deterministic and fast: a fixed seed, no example database, no per-example deadline."""
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None)


def _decodes_or_refuses(payload: bytes, max_bytes: int = MAX) -> None:
    try:
        reg = decode(payload, max_bytes)
    except RegistryMessageError:
        return
    assert reg is None or (
        isinstance(reg.role, Role)
        and reg.address.url.startswith(("http://", "https://"))
        and header_safe(reg.address.url)
        and (reg.address.zmq_address is None or header_safe(reg.address.zmq_address))
    )


@_fuzz(1000)
@given(_values)
def test_fuzz_any_msgpack_value(value):
    _decodes_or_refuses(msgpack.packb(value))


@_fuzz(1000)
@given(_registration_shaped)
def test_fuzz_registration_shaped_maps(message):
    _decodes_or_refuses(msgpack.packb(message))


@_fuzz(600)
@given(st.binary(max_size=200), st.integers(min_value=0, max_value=300))
def test_fuzz_raw_bytes(payload, max_bytes):
    _decodes_or_refuses(payload, max_bytes)


def _legacy(**overrides):
    """A valid MoRIIO legacy message with some fields replaced."""
    fields = {
        "type": "register",
        "role": "P",
        "request_address": "http://h:1/v1/completions",
        "handshake_port": 6301,
        "notify_port": 61005,
        "transfer_mode": "READ",
    }
    return _enc({**fields, **overrides})


def test_legacy_helper_is_valid():
    assert decode(_legacy(), MAX).format == "moriio-legacy"


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(_enc({"type": ["P"]}), id="type-list"),
        pytest.param(_enc({"type": {"P": 1}}), id="type-map"),
        pytest.param(_legacy(role={"a": 1}), id="role-map"),
        pytest.param(_legacy(role=["P"]), id="role-list"),
        pytest.param(
            _enc({"type": "P", "http_address": "h:\u00b2", "zmq_address": "z"}),
            id="http-port-superscript-digit",
        ),
        pytest.param(_legacy(request_address="http://h:99999/"), id="url-port-too-big"),
        pytest.param(_legacy(request_address="http://h:x/"), id="url-port-not-a-number"),
        pytest.param(_legacy(request_address="http://[::1/"), id="url-bad-ipv6"),
        pytest.param(_legacy(request_address="http://h:0/"), id="url-port-zero"),
        pytest.param(_legacy(handshake_port="9" * 5000), id="port-5000-digits"),
        pytest.param(_legacy(notify_port="\u00b2"), id="port-superscript-digit"),
        pytest.param(b"\x81\x91\x01\x02", id="list-as-map-key"),
        pytest.param(b"\x81\xa4type\xd6\xff\x00\x00\x00\x01", id="type-timestamp-ext"),
        pytest.param(b"\x81\xa4type\xd4\x80\x00", id="type-reserved-ext"),
        pytest.param(b"\x91" * 60_000, id="nesting-past-msgpack-stack"),
    ],
)
def test_regression_odd_field_types_raise_message_error(payload):
    """Issue item 0: ``{"type": ["P"]}`` raised TypeError in the role lookup (hashing a
    list), which ended the registry's serve loop without a log line, so every later
    heartbeat was ignored until a restart. The other cases raised ValueError the same way.
    """
    with pytest.raises(RegistryMessageError):
        decode(payload, MAX)


# -- issue 19: strings that go into headers and request ids, ports, unroutable hosts ------


def _p2p(http_address="10.0.0.1:20003", zmq_address="10.0.0.1:21001", **extra):
    return _enc({"type": "P", "http_address": http_address, "zmq_address": zmq_address, **extra})


@pytest.mark.parametrize(
    "zmq_address",
    [
        pytest.param("10.0.0.1:21001\r\nX-Injected: 1", id="crlf"),
        pytest.param("10.0.0.1:21001\n", id="trailing-lf"),
        pytest.param("10.0.0.1:2100\u20ac", id="not-latin-1"),
        pytest.param("caf\u00e9:21001", id="latin-1-not-ascii"),
        pytest.param("10.0.0.1\x00:21001", id="nul"),
        pytest.param("10.0.0.1:21001\x7f", id="del"),
        pytest.param("z", id="no-port"),
        pytest.param("host:10.0.0.1,handshake:6301,notify:610050", id="moriio-port-too-long"),
        pytest.param("host:\u00e9,handshake:6301,notify:61005", id="moriio-host-not-ascii"),
    ],
)
def test_regression_unsendable_zmq_address_is_refused_at_decode(zmq_address):
    """Issue 19 row 5: a zmq_address with CR/LF or non-Latin-1 text was accepted; every
    request through that instance then failed with a 500 (its request id could not be put
    in a header), never counted against it, and it stayed routable."""
    with pytest.raises(RegistryMessageError):
        decode(_p2p(zmq_address=zmq_address), MAX)
    with pytest.raises(RegistryMessageError):
        decode(_p2p(zmq_address=zmq_address, dp_size=1, tp_size=1, transfer_mode="READ"), MAX)


@pytest.mark.parametrize(
    "http_address",
    [
        "10.0.0.1:\u0668\u0660\u0660\u0660",  # Arabic-Indic 8000: int() reads it
        "10.0.0.1:\u00b2",
        "0.0.0.0:8000",
        "[::]:8000",
        "224.0.0.1:8000",
        "h\n:8000",
    ],
)
def test_http_address_ports_are_ascii_and_hosts_routable(http_address):
    with pytest.raises(RegistryMessageError):
        decode(_p2p(http_address=http_address), MAX)


def test_http_address_is_written_canonically():
    for spelling in ("[::ffff:10.0.0.1]:20003", "10.0.0.1:20003", "0x0a.0.0.1:20003"):
        assert decode(_p2p(http_address=spelling), MAX).address.url == "http://10.0.0.1:20003"
    assert decode(_p2p(http_address="Node-1:8"), MAX).address.url == "http://node-1:8"


@pytest.mark.parametrize(
    "overrides",
    [
        {"handshake_port": "\u0668\u0660"},
        {"notify_port": "\uff18\uff10"},
        {"request_address": "http://0.0.0.0:8100/v1/completions"},
        {"request_address": "http://\u00e4\u20ac:8100/v1/completions"},
        {"request_address": "http://a b:8100/v1/completions"},
    ],
)
def test_legacy_ports_and_hosts_refused(overrides):
    with pytest.raises(RegistryMessageError):
        decode(_legacy(**overrides), MAX)


def test_a_registration_may_name_its_kv_events_endpoints():
    payload = {"type": "P", "http_address": "10.0.0.1:20003", "zmq_address": "10.0.0.1:21001"}
    events = {
        "kv_events_endpoint": "tcp://10.0.0.1:5557",
        "kv_events_replay_endpoint": "tcp://{host}:5558",
    }
    reg = decode(_enc({**payload, **events}), MAX)
    assert reg.address.kv_events_endpoint == "tcp://10.0.0.1:5557"
    assert reg.address.kv_events_replay_endpoint == "tcp://{host}:5558"
    assert decode(_enc(payload), MAX).address.kv_events_endpoint is None
    for bad in ("http://x:1", 5557, "tcp://{nope}:1", "tcp://" + "x" * 600):
        with pytest.raises(RegistryMessageError, match="kv_events_endpoint"):
            decode(_enc({**payload, "kv_events_endpoint": bad}), MAX)
