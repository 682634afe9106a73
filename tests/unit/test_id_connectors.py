"""The id-embedding connectors against vLLM's own request-id regexes and field contracts."""

import copy
import re

import pytest

from pdproxy.config.proxy import ProxyConfig
from pdproxy.connectors import load_connector
from pdproxy.types import Endpoint, EngineAddress, PairDecision, Role, Source

# vLLM's regexes (PROTOCOLS.md §2.1, §2.2)
P2P_PRODUCER = re.compile(r"___decode_addr_(.*):(\d+)")
P2P_CONSUMER = re.compile(r"___prefill_addr_(.*):(\d+)___")
MORIIO_PREFILL = re.compile(r"___prefill_addr_(.+?)___decode_addr_")
MORIIO_DECODE = re.compile(r"___decode_addr_(.+)_[0-9a-f]{32}(?:-.*)?$")

BODY = {"model": "m", "prompt": "p", "max_tokens": 9, "stream": True}
P_ZMQ = "host:10.0.0.1,handshake:6301,notify:61005"
D_ZMQ = "host:10.0.0.2,handshake:6302,notify:61006"


def _endpoint(role, zmq, dp=1, tp=1, mode=None, bootstrap=None, engine_ids=()):
    address = EngineAddress(
        url=f"http://{role.value}:1",
        zmq_address=zmq,
        dp_size=dp,
        tp_size=tp,
        transfer_mode=mode,
        bootstrap_url=bootstrap,
    )
    return Endpoint.new(role=role, address=address, source=Source.REGISTERED, engine_ids=engine_ids)


def _connector(name, mode=None):
    addr = (EngineAddress(url="http://a:1"),)
    return load_connector(
        ProxyConfig(prefill=addr, decode=addr, kv_connector=name, transfer_mode=mode)
    )


def test_p2p_request_id_parses_with_vllm_regexes():
    c = _connector("p2p-nccl")
    decision = PairDecision(
        _endpoint(Role.PREFILL, "10.0.0.1:21001"), _endpoint(Role.DECODE, "10.0.0.2:22001")
    )
    t = c.begin(decision, "client-id-ignored")
    assert P2P_PRODUCER.search(t.request_id).groups() == ("10.0.0.2", "22001")
    assert P2P_CONSUMER.search(t.request_id).groups() == ("10.0.0.1", "21001")
    # vLLM appends "-<8hex>" to internal ids; the regexes must still work
    assert P2P_PRODUCER.search(t.request_id + "-0-1a2b3c4d").group(1) == "10.0.0.2"
    assert not c.runs_concurrently(t)
    assert "kv_transfer_params" not in c.prefill_body(BODY, t)
    assert c.decode_body(BODY, t, {"choices": []}) == BODY


@pytest.mark.parametrize("mode", ["READ", "WRITE"])
def test_moriio_ids_and_params(mode):
    c = _connector("moriio")
    p = _endpoint(Role.PREFILL, P_ZMQ, dp=2, tp=4, mode=mode)
    d = _endpoint(Role.DECODE, D_ZMQ, dp=1, tp=8, mode=mode)
    t = c.begin(PairDecision(p, d, prefill_dp_rank=1), None)
    assert MORIIO_PREFILL.search(t.request_id).group(1) == P_ZMQ
    assert MORIIO_DECODE.search(t.request_id + "-0-1a2b3c4d").group(1) == D_ZMQ
    assert t.transfer_id.startswith("tx-")
    assert c.runs_concurrently(t) is (mode == "WRITE")
    pp = c.prefill_body(BODY, t)["kv_transfer_params"]
    assert pp["do_remote_decode"] is True and pp["transfer_id"] == t.transfer_id
    assert (pp["remote_dp_size"], pp["remote_tp_size"]) == (1, 8)
    answer = {
        "kv_transfer_params": {
            "remote_engine_id": "eng-p",
            "remote_block_ids": [3, 4],
            "transfer_id": t.transfer_id,
            "remote_host": "x",
        }
    }
    before = copy.deepcopy(BODY)
    dp = c.decode_body(BODY, t, answer if mode == "READ" else None)["kv_transfer_params"]
    assert before == BODY
    assert dp["do_remote_prefill"] is True and dp["transfer_id"] == t.transfer_id
    assert (dp["remote_dp_size"], dp["remote_tp_size"], dp["remote_dp_rank"]) == (2, 4, 1)
    if mode == "READ":
        assert (dp["remote_engine_id"], dp["remote_block_ids"]) == ("eng-p", [3, 4])
        assert "remote_host" not in dp


def test_moriio_default_mode_from_config():
    c = _connector("moriio", mode="WRITE")
    t = c.begin(PairDecision(_endpoint(Role.PREFILL, P_ZMQ), _endpoint(Role.DECODE, D_ZMQ)), None)
    assert c.runs_concurrently(t)
    assert "remote_dp_rank" not in c.decode_body(BODY, t, None)["kv_transfer_params"]


def test_mooncake_params():
    c = _connector("mooncake")
    p = _endpoint(Role.PREFILL, None, bootstrap="http://prefill:8998", engine_ids=("e0", "e1"))
    t = c.begin(PairDecision(p, _endpoint(Role.DECODE, None), prefill_dp_rank=1), "rid-1")
    assert t.request_id == "rid-1" and t.transfer_id == "xfer-rid-1"
    assert c.runs_concurrently(t)
    pp = c.prefill_body(BODY, t)["kv_transfer_params"]
    assert pp == {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": "xfer-rid-1"}
    dp = c.decode_body(BODY, t, None)["kv_transfer_params"]
    assert dp == {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_bootstrap_addr": "http://prefill:8998",
        "remote_engine_id": "e1",
        "transfer_id": "xfer-rid-1",
    }
    assert c.prefill_bootstrap_url(p.address) == "http://prefill:8998/query"


def test_mooncake_bootstrap_parsing():
    c = _connector("mooncake")
    answer = {
        "1": {"engine_id": "b", "worker_addr": {}},
        "0": {"engine_id": "a", "worker_addr": {}},
    }
    assert c.parse_bootstrap(answer) == ("a", "b")
    for bad in (
        {},
        [],
        {"0": {}},
        {"1": {"engine_id": "x"}},
        {"0": {"engine_id": 5}},
        {"x": {"engine_id": "a"}},
    ):
        with pytest.raises(ValueError):
            c.parse_bootstrap(bad)
