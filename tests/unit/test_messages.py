import msgpack
import pytest

from pdproxy.discovery.messages import decode
from pdproxy.errors import RegistryMessageError
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
