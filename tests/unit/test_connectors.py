import copy

import pytest

from pdproxy.config import KV_CONNECTORS, ProxyConfig
from pdproxy.connectors import load_connector
from pdproxy.types import Endpoint, EngineAddress, PairDecision, Role, Source

BODY = {"model": "m", "prompt": "p", "max_tokens": 9, "stream": True, "min_tokens": 2}


def _decision():
    p = Endpoint(role=Role.PREFILL, address=EngineAddress(url="http://p:1"), source=Source.STATIC)
    d = Endpoint(role=Role.DECODE, address=EngineAddress(url="http://d:1"), source=Source.STATIC)
    return PairDecision(p, d)


def _connector(name):
    addr = (EngineAddress(url="http://a:1"),)
    return load_connector(ProxyConfig(prefill=addr, decode=addr, kv_connector=name))


def test_every_table_entry_loads():
    for name in KV_CONNECTORS:
        assert _connector(name) is not None


def test_nixl_prefill_asks_for_remote_decode():
    c = _connector("nixl")
    t = c.begin(_decision(), "client-id")
    assert t.request_id == "client-id"
    body = c.prefill_body(BODY, t)
    assert body["kv_transfer_params"]["do_remote_decode"] is True
    assert body["kv_transfer_params"]["do_remote_prefill"] is False
    assert body["max_tokens"] == 1 and body["stream"] is False and "min_tokens" not in body
    assert c.runs_concurrently(t) is False


def test_nixl_decode_forwards_params_verbatim():
    c = _connector("nixl")
    t = c.begin(_decision(), None)
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "brand_new_key": {"x": 1}}
    before = copy.deepcopy(BODY)
    body = c.decode_body(BODY, t, {"id": "cmpl-x", "kv_transfer_params": params})
    assert body["kv_transfer_params"] == params
    assert body["max_tokens"] == 9 and body["stream"] is True and body["min_tokens"] == 2
    assert before == BODY


@pytest.mark.parametrize(
    "answer", [{"id": "x"}, {"kv_transfer_params": None}, {"kv_transfer_params": "junk"}]
)
def test_nixl_decode_without_params_recomputes(answer):
    c = _connector("nixl")
    body = c.decode_body(BODY, c.begin(_decision(), None), answer)
    assert "kv_transfer_params" not in body


def test_example_sends_no_params():
    c = _connector("example")
    t = c.begin(_decision(), None)
    assert "kv_transfer_params" not in c.prefill_body(BODY, t)
    assert c.decode_body(BODY, t, {"kv_transfer_params": {"a": 1}}) == BODY
    assert c.runs_concurrently(t) is False
