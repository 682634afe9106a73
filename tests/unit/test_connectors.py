import copy

import pytest

from pdproxy.config.proxy import KV_CONNECTORS, ProxyConfig
from pdproxy.connectors import load_connector
from pdproxy.types import Endpoint, EngineAddress, PairDecision, Role, Source

BODY = {"model": "m", "prompt": "p", "max_tokens": 9, "stream": True, "min_tokens": 2}


def _decision():
    p = Endpoint.new(
        role=Role.PREFILL, address=EngineAddress(url="http://p:1"), source=Source.STATIC
    )
    d = Endpoint.new(
        role=Role.DECODE, address=EngineAddress(url="http://d:1"), source=Source.STATIC
    )
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


PARAMS = {"do_remote_prefill": True, "remote_block_ids": [[3, 4]], "remote_engine_id": "eng-1"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.mark.parametrize(
    ("name", "reason", "reuses"),
    [
        ("nixl", "connect", True),  # the decode never saw the leg: P's KV is intact
        ("nixl", "5xx", False),  # it may have read (and P freed) the KV
        ("nixl", "timeout", False),
        ("example", "5xx", True),  # files on shared storage survive a read
        ("p2p-nccl", "connect", False),  # P pushes to the decode its id names
        ("mooncake", "connect", False),  # concurrent legs: a fresh pair
        ("moriio", "connect", True),  # READ (the default mode): a pull, like NIXL
        ("moriio", "5xx", False),
    ],
)
def test_decode_retry_scope_is_the_connectors(name, reason, reuses):
    c = _connector(name)
    assert c.decode_retry_reuses_prefill(c.begin(_decision(), None), reason) is reuses


def test_nixl_releases_through_a_warm_decode_with_a_leg_vllm_rejects():
    c = _connector("nixl")
    answer = {"kv_transfer_params": PARAMS}
    assert c.kv_source(answer) == "eng-1"
    leg = c.release_leg(CHAT, answer, warm=True)
    assert leg.path == "/v1/completions" and leg.expect == 400
    assert leg.body["stream"] is True and leg.body["use_beam_search"] is True
    assert leg.body["kv_transfer_params"] == PARAMS and leg.body["model"] == "m"
    assert "request_id" not in leg.body


def test_nixl_releases_through_a_cold_decode_with_a_one_token_read():
    c = _connector("nixl")
    leg = c.release_leg(CHAT, {"kv_transfer_params": PARAMS}, warm=False)
    assert leg.path == "/v1/chat/completions" and leg.expect == 200
    assert leg.body["max_tokens"] == 1 and leg.body["stream"] is False
    assert leg.body["messages"] == CHAT["messages"]
    assert leg.body["kv_transfer_params"] == PARAMS


def test_nixl_releases_a_token_in_request_through_generate():
    c = _connector("nixl")
    original = {
        "model": "m",
        "token_ids": [5, 6, 7],
        "sampling_params": {"max_tokens": 9, "min_tokens": 2},
        "stream": True,
    }
    leg = c.release_leg(original, {"kv_transfer_params": PARAMS}, warm=False)
    assert leg.path == "/inference/v1/generate" and leg.expect == 200
    # a minimum stays as 1 (EOS masked, as for the client's first token)
    assert leg.body["sampling_params"] == {"max_tokens": 1, "min_tokens": 1}
    assert leg.body["stream"] is False
    assert leg.body["token_ids"] == [5, 6, 7] and leg.body["kv_transfer_params"] == PARAMS


@pytest.mark.parametrize("answer", [{}, {"kv_transfer_params": {"remote_block_ids": []}}])
def test_nothing_to_release_without_blocks(answer):
    assert _connector("nixl").release_leg(CHAT, answer, warm=True) is None


@pytest.mark.parametrize("name", ["example", "p2p-nccl", "mooncake", "moriio"])
def test_other_connectors_have_no_release(name):
    c = _connector(name)
    assert c.kv_source({"kv_transfer_params": PARAMS}) is None
    assert c.release_leg(CHAT, {"kv_transfer_params": PARAMS}, warm=True) is None


def test_a_decode_remembers_a_bounded_number_of_kv_sources():
    d = _decision().decode
    for i in range(5000):
        d.legs.read_from(f"eng-{i}")
    assert len(d.legs.kv_sources) == 1024 and "eng-4999" in d.legs.kv_sources
