"""nixl-push: the legs' bodies, the prefill coordinates learned from answers (never
guessed, never coerced), the dispatch choice, and a stranded decode's way back."""

from __future__ import annotations

import pytest

from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.resilience import OutlierConfig
from pdproxy.connectors import load_connector
from pdproxy.connectors.nixl_push import NixlPushConnector, PushPeers, coordinates
from pdproxy.resilience.outlier import STRANDED_MAX, OutlierDetector
from pdproxy.types import Endpoint, EngineAddress, EngineLoad, PairDecision, Role, Source

BODY = {"model": "m", "prompt": "p", "max_tokens": 9, "stream": True}
# What vLLM 0.32's push prefill answers (push_scheduler.py: request_finished).
ANSWER = {
    "kv_transfer_params": {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [1, 2],
        "remote_engine_id": "eng-a_dp1",
        "remote_request_id": "cmpl-x-0-1a2b3c4d",
        "remote_host": "10.0.0.1",
        "remote_port": 5601,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 7,
        "transfer_mode": "push",
    }
}


def _endpoint(role: Role, url: str) -> Endpoint:
    return Endpoint.new(role=role, address=EngineAddress(url=url), source=Source.STATIC)


def _decision(rank: int | None = 1, decode_cached: int | None = None) -> PairDecision:
    return PairDecision(
        _endpoint(Role.PREFILL, "http://p:1"),
        _endpoint(Role.DECODE, "http://d:1"),
        prefill_dp_rank=rank,
        decode_cached=decode_cached,
    )


def _connector(dispatch: str = "auto") -> NixlPushConnector:
    addr = (EngineAddress(url="http://a:1"),)
    config = ProxyConfig(
        prefill=addr, decode=addr, kv_connector="nixl-push", push_dispatch=dispatch
    )
    connector = load_connector(config)
    assert isinstance(connector, NixlPushConnector)
    return connector


def test_the_prefill_leg_is_one_token_that_asks_for_a_remote_decode():
    c = _connector()
    t = c.begin(_decision(), "client-id")
    body = c.prefill_body(BODY, t)
    assert body["kv_transfer_params"] == {"do_remote_decode": True}
    assert body["max_tokens"] == 1 and body["stream"] is False
    assert t.request_id == "client-id"


def test_the_first_request_to_a_prefill_rank_is_serial_and_teaches_its_coordinates():
    c = _connector("concurrent")
    t = c.begin(_decision(), None)
    assert c.dispatch_of(t, streaming=True) == "serial:unknown-prefill"
    # Serial: P's answer is the whole decode leg, verbatim.
    assert c.decode_body(BODY, t, ANSWER)["kv_transfer_params"] == ANSWER["kv_transfer_params"]
    c.observe_prefill(t.decision, ANSWER)
    # Another rank of the same prefill is still unknown: nothing is guessed.
    assert c.dispatch_of(c.begin(_decision(rank=0), None), streaming=True) != "concurrent"
    t2 = c.begin(_decision(), "id-2")
    assert c.dispatch_of(t2, streaming=True) == "concurrent"
    params = c.decode_body(BODY, t2, None)["kv_transfer_params"]
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "eng-a_dp1",
        "remote_host": "10.0.0.1",
        "remote_port": 5601,
        "tp_size": 1,
        "pp_size": 1,
        "remote_request_id": "id-2",
    }


def test_dispatch_modes():
    for mode, streaming, cached, expected in [
        ("serial", True, 100, "serial"),
        ("concurrent", False, 100, "serial:whole-answer"),
        ("concurrent", True, None, "concurrent"),
        ("auto", True, None, "serial:cold-decode"),
        ("auto", True, 0, "serial:cold-decode"),
        ("auto", True, 16, "concurrent"),
    ]:
        c = _connector(mode)
        c.observe_prefill(_decision(), ANSWER)
        t = c.begin(_decision(decode_cached=cached), None)
        assert c.dispatch_of(t, streaming=streaming) == expected, (mode, streaming, cached)


def test_a_transfer_keeps_the_coordinates_it_began_with():
    c = _connector("concurrent")
    c.observe_prefill(_decision(), ANSWER)
    t = c.begin(_decision(), None)
    c.peers.forget("http://p:1")  # another request stranded a decode meanwhile
    assert c.decode_body(BODY, t, None)["kv_transfer_params"]["remote_engine_id"] == "eng-a_dp1"
    assert c.dispatch_of(c.begin(_decision(), None), streaming=True) == "serial:unknown-prefill"


def _params(**changes):
    return {**ANSWER["kv_transfer_params"], **changes}


@pytest.mark.parametrize(
    "params",
    [
        None,
        "junk",
        _params(transfer_mode="pull"),
        {k: v for k, v in _params().items() if k != "remote_host"},
        _params(remote_port="5601"),  # a string is not coerced
        _params(remote_port=True),
        _params(remote_port=70000),
        _params(tp_size=0),
        _params(tp_size=1.0),
        _params(remote_engine_id=""),
        _params(remote_engine_id="x" * 513),
        _params(remote_host=["h"]),
        _params(pp_size=None),
    ],
)
def test_a_hostile_or_foreign_answer_teaches_nothing(params):
    assert coordinates(params) is None
    peers = PushPeers()
    peers.learn("http://p:1", 0, params)
    assert peers.known() == 0


def test_a_new_engine_id_is_a_restart_and_replaces_the_old():
    peers = PushPeers()
    peers.learn("http://p:1", 1, _params())
    peers.learn("http://p:1", 1, _params())
    assert peers.restarts == 0
    peers.learn("http://p:1", 1, _params(remote_engine_id="eng-b_dp1"))
    assert peers.restarts == 1 and peers.get("http://p:1", 1).engine_id == "eng-b_dp1"


def test_the_book_is_bounded():
    peers = PushPeers()
    for i in range(5000):
        peers.learn(f"http://p{i}:1", 0, _params(remote_engine_id=f"e{i}", remote_port=1 + i))
    assert peers.known() == 4096 and peers.get("http://p4999:1", 0) is not None
    assert peers.get("http://p0:1", 0) is None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _load(kv_usage: float, at: float) -> EngineLoad:
    return EngineLoad(running=0, waiting=0, kv_usage=kv_usage, scraped_at=at)


def test_a_stranded_decode_is_out_until_a_later_scrape_shows_its_kv_freed():
    clock = Clock()
    outliers = OutlierDetector(OutlierConfig(), clock)
    d = _endpoint(Role.DECODE, "http://d:1")
    d.load.engine_load = _load(0.0, at=99.0)  # idle before: says nothing about after
    outliers.on_stranded(d)
    assert outliers.stranded(d) and not outliers.available(d)
    assert outliers.usable((d,)) == (d,)  # the last decode left is still a better bet
    clock.now += 1
    d.load.engine_load = _load(0.2, at=clock.now)  # its leaked blocks
    assert not outliers.available(d)
    clock.now += 1
    d.load.engine_load = _load(0.0, at=clock.now)  # freed (the write came, or a restart)
    assert outliers.available(d) and not outliers.stranded(d)


def test_a_stranded_decode_whose_kv_never_clears_is_back_after_the_cap():
    clock = Clock()
    outliers = OutlierDetector(OutlierConfig(), clock)
    d = _endpoint(Role.DECODE, "http://d:1")
    outliers.on_stranded(d)
    clock.now += STRANDED_MAX - 1
    assert not outliers.available(d)
    clock.now += 1
    assert outliers.available(d)


def test_a_prefill_answering_another_prefills_nixl_side_is_not_believed():
    """A decode sent to another engine's side channel registers there, and nothing ever
    writes it: a hostile (or misconfigured) answer must not make the legs concurrent."""
    c = _connector("concurrent")
    c.observe_prefill(_decision(), ANSWER)  # http://p:1 rank 1 is eng-a_dp1 at 10.0.0.1:5601
    liar = PairDecision(
        _endpoint(Role.PREFILL, "http://liar:1"), _endpoint(Role.DECODE, "http://d:1")
    )
    c.observe_prefill(liar, ANSWER)  # the same engine id and side channel
    c.observe_prefill(liar, {"kv_transfer_params": _params(remote_engine_id="mine")})  # port
    assert c.dispatch_of(c.begin(liar, None), streaming=True) == "serial:unknown-prefill"
    assert c.peers.known() == 1
    # serially either: its answer naming the other prefill is not sent on to the decode
    assert "kv_transfer_params" not in c.decode_body(BODY, c.begin(liar, None), ANSWER)
    assert "kv_transfer_params" in c.decode_body(BODY, c.begin(_decision(), None), ANSWER)


@pytest.mark.parametrize(
    "params",
    [
        {k: v for k, v in _params().items() if k != "remote_request_id"},
        {k: v for k, v in _params().items() if k != "tp_size"},
        _params(remote_request_id=7),
        _params(remote_port="5601"),
    ],
)
def test_a_serial_answer_that_would_kill_the_decode_is_not_forwarded(params):
    """vLLM's push decode reads its keys unchecked (a KeyError kills its engine): a prefill's
    answer missing one, or of the wrong type, sends the decode no params (it recomputes)."""
    c = _connector()
    t = c.begin(_decision(), None)
    assert "kv_transfer_params" not in c.decode_body(BODY, t, {"kv_transfer_params": params})


def test_a_prefill_whose_leg_fails_is_relearned():
    c = _connector("concurrent")
    c.observe_prefill(_decision(), ANSWER)
    assert c.dispatch_of(c.begin(_decision(), None), streaming=True) == "concurrent"
    c.prefill_failed(_decision())  # it may be restarting under the same engine id
    assert c.dispatch_of(c.begin(_decision(), None), streaming=True) == "serial:unknown-prefill"
    c.observe_prefill(_decision(), ANSWER)  # its next answer teaches them again
    assert c.dispatch_of(c.begin(_decision(), None), streaming=True) == "concurrent"
