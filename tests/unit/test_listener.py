"""pdproxy.runtime.listener's pure parts: the connection cap, the refusals' bytes, the limits'
validation (the protocol itself is attacked in tests/hostile/test_clients.py)."""

from __future__ import annotations

import logging
import resource

import orjson
import pytest

from pdproxy.config.listener import ClientLimits
from pdproxy.config.proxy import ProxyConfig
from pdproxy.errors import ConfigError, HeadTooLarge, TooManyConnections
from pdproxy.runtime.connection_cap import connection_cap
from pdproxy.runtime.listener import WARN_EVERY, HardenedProtocol, Refusals, hardened_protocol
from pdproxy.runtime.raw_response import error_bytes
from pdproxy.runtime.server import uvicorn_config
from pdproxy.types import EngineAddress


def test_the_connection_cap_is_half_the_open_file_limit_unless_given():
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert connection_cap(ClientLimits()) == max(1, soft // 2)
    assert connection_cap(ClientLimits(max_connections=7)) == 7


def test_each_config_gets_its_own_protocol_class():
    limits = ClientLimits(max_head_bytes=2048, max_connections=3)
    protocol = hardened_protocol(limits)
    assert issubclass(protocol, HardenedProtocol)
    assert protocol.client_limits is limits and protocol.max_connections == 3
    assert HardenedProtocol.client_limits == ClientLimits()  # the base is untouched


def test_the_cli_and_every_worker_serve_through_it():
    config = ProxyConfig(
        prefill=(EngineAddress(url="http://p:1"),),
        decode=(EngineAddress(url="http://d:2"),),
        clients=ClientLimits(keepalive_timeout=9, max_connections=5),
    )
    settings = uvicorn_config(object(), config)
    assert issubclass(settings.http, HardenedProtocol)
    assert settings.http.max_connections == 5
    assert settings.timeout_keep_alive == 9 and settings.ws == "none"


def test_a_refusal_is_one_whole_json_response_that_ends_the_connection():
    raw = error_bytes(HeadTooLarge("too big"), [(b"server", b"uvicorn")])
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 431 Request Header Fields Too Large"
    assert b"connection: close" in lines and b"server: uvicorn" in lines
    assert f"content-length: {len(body)}".encode() in lines
    error = orjson.loads(body)["error"]
    assert error == {
        "message": "too big",
        "type": "RequestHeaderFieldsTooLargeError",
        "param": None,
        "code": 431,
    }
    busy = error_bytes(TooManyConnections("busy"), [])
    assert busy.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert b"\r\nretry-after: 1\r\n" in busy


@pytest.mark.parametrize(
    "fields",
    [
        {"max_head_bytes": 1000},
        {"max_headers": 0},
        {"header_timeout": 0},
        {"body_timeout": -1},
        {"keepalive_timeout": 0},
        {"max_connections": -1},
    ],
)
def test_limits_out_of_range_are_a_config_error(fields):
    with pytest.raises(ConfigError):
        ClientLimits(**fields)


def test_turned_away_clients_are_warned_of_once_per_interval(caplog):
    refusals = Refusals()
    with caplog.at_level(logging.WARNING, logger="pdproxy.runtime.listener"):
        for now in (100.0, 101.0, 102.0, 100.0 + WARN_EVERY):
            refusals.add(now, cap=8)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "1 client request(s) got 503: all 8 client connections busy (--max-client-connections)",
        "3 client request(s) got 503: all 8 client connections busy (--max-client-connections)",
    ]
    assert (
        hardened_protocol(ClientLimits()).refusals is not hardened_protocol(ClientLimits()).refusals
    )
