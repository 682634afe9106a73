"""Pure parts of the pass-through endpoints: the route table, response-id pins, the
/v1/responses body, the Responses stream framing and the shared usable-instance filter."""

from __future__ import annotations

import orjson
import pytest

from pdproxy.config.resilience import OutlierConfig
from pdproxy.errors import UpstreamProtocolError
from pdproxy.proxying.framing import RESPONSES_SSE
from pdproxy.proxying.relay import StreamRelay
from pdproxy.proxying.watchdog import StreamWatchdog
from pdproxy.resilience.outlier import OutlierDetector
from pdproxy.types import Endpoint, EngineAddress, Role, Source
from pdproxy.wire.routes import ROUTES, new_response_id, pin, pinned, responses_body
from tests.unit.test_relay import FakeUpstream


def _endpoint(url: str) -> Endpoint:
    return Endpoint.new(role=Role.DECODE, address=EngineAddress(url=url), source=Source.STATIC)


def test_the_route_table():
    paths = {r.path: r.method for r in ROUTES}
    assert paths.pop("/version") == "GET"
    assert set(paths.values()) == {"POST"}
    assert set(paths) == {
        "/tokenize",
        "/detokenize",
        "/v1/completions/render",
        "/v1/chat/completions/render",
        "/v1/embeddings",
        "/pooling",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/v1/responses",
    }
    assert [r.path for r in ROUTES if r.responses] == ["/v1/responses"]


def test_a_response_id_names_its_instance():
    a, b = _endpoint("http://10.0.0.1:8200"), _endpoint("http://10.0.0.2:8200")
    response_id = new_response_id(a.url)
    assert response_id.startswith("resp_" + pin(a.url)) and len(response_id) == 5 + 32
    assert new_response_id(a.url) != response_id
    assert pinned(response_id, [b, a]) is a
    assert pinned(response_id, [b]) is None  # its instance is gone
    assert pin(a.url) == pin("http://10.0.0.1:8200")  # stable: any replica agrees


@pytest.mark.parametrize("response_id", [None, 7, "", "resp_", "resp_abc", "chatcmpl-1"])
def test_ids_without_a_pin(response_id):
    assert pinned(response_id, [_endpoint("http://h:1")]) is None


def test_the_responses_body_is_named_and_never_carries_kv_params():
    original = {"input": "hi", "kv_transfer_params": {"do_remote_prefill": True}}
    body = responses_body(original, "http://h:1")
    assert body["request_id"].startswith("resp_" + pin("http://h:1"))
    assert "kv_transfer_params" not in body and "request_id" not in original
    assert responses_body({"input": "hi", "request_id": "mine"}, "http://h:1")["request_id"] == (
        "mine"
    )


async def _drain(relay: StreamRelay) -> bytes:
    await relay.prime()
    out = []
    while (chunk := await relay.next_chunk()) is not None:
        out.append(chunk)
    return b"".join(out)


def _event(name: str, **fields: object) -> bytes:
    data = orjson.dumps({**fields, "sequence_number": 0, "type": name})
    return b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"


HEAD = _event("response.created")
COMPLETED = _event("response.completed", response={})


@pytest.mark.parametrize("split", [5, 40, len(COMPLETED) - 3])
async def test_a_complete_responses_stream_is_relayed_as_it_came(split):
    chunks = [HEAD, COMPLETED[:split], COMPLETED[split:]]
    upstream = FakeUpstream(chunks)
    relay = StreamRelay(upstream, lambda: None, StreamWatchdog(600.0), RESPONSES_SSE)
    assert await _drain(relay) == b"".join(chunks)
    assert relay.failure is None and upstream.released


async def test_a_cut_responses_stream_ends_with_one_error_event():
    head, delta = HEAD, _event("response.output_text.delta", delta=" a")
    relay = StreamRelay(
        FakeUpstream([head, delta]), lambda: None, StreamWatchdog(600.0), RESPONSES_SSE
    )
    out = await _drain(relay)
    assert isinstance(relay.failure, UpstreamProtocolError)
    tail = out.removeprefix(head + delta)
    name, data = tail.rstrip(b"\n").split(b"\n")
    assert name == b"event: error" and b"[DONE]" not in out
    assert orjson.loads(data.removeprefix(b"data: "))["error"]["type"] == "BadGatewayError"


def test_usable_keeps_the_pool_unless_it_must_drop_some():
    clock = [100.0]
    outliers = OutlierDetector(OutlierConfig(), lambda: clock[0])
    a, b = _endpoint("http://a:1"), _endpoint("http://b:1")
    pool = (a, b)
    assert outliers.usable(pool) is pool  # the snapshot itself: per-snapshot caches hold
    assert outliers.usable(pool, {"http://a:1"}) == (b,)
    b.health.ejected_until = 200.0
    assert outliers.usable(pool) == (a,)
    assert outliers.usable(pool, {"http://a:1"}) == (b,)  # only ejected left: better than none
