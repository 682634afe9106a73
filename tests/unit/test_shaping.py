import copy

import pytest

from pdproxy import shaping

ORIGINAL = {
    "model": "m",
    "prompt": "hello",
    "max_tokens": 50,
    "max_completion_tokens": 40,
    "stream": True,
    "stream_options": {"include_usage": True},
    "min_tokens": 5,
    "min_completion_tokens": 5,
    "temperature": 0,
    "kv_transfer_params": {"remote_host": "evil"},
    "nested": {"a": [1, 2]},
}


def test_prefill_body_clamps_and_strips_without_touching_original():
    before = copy.deepcopy(ORIGINAL)
    body = shaping.prefill_body(ORIGINAL, {"do_remote_decode": True})
    assert before == ORIGINAL
    assert body["max_tokens"] == 1
    assert body["max_completion_tokens"] == 1
    assert body["stream"] is False
    for dropped in ("stream_options", "min_tokens", "min_completion_tokens"):
        assert dropped not in body
    assert body["kv_transfer_params"] == {"do_remote_decode": True}
    assert body["temperature"] == 0 and body["prompt"] == "hello"


def test_prefill_body_adds_max_completion_tokens_only_when_present():
    body = shaping.prefill_body({"model": "m", "messages": []}, None)
    assert body["max_tokens"] == 1
    assert "max_completion_tokens" not in body
    assert "kv_transfer_params" not in body


def test_prefill_params_are_copied_not_shared():
    params = {"do_remote_decode": True}
    body = shaping.prefill_body({"model": "m"}, params)
    body["kv_transfer_params"]["x"] = 1
    assert params == {"do_remote_decode": True}


def test_decode_body_is_original_plus_params():
    before = copy.deepcopy(ORIGINAL)
    params = {"remote_engine_id": "e", "unknown_future_key": [1]}
    body = shaping.decode_body(ORIGINAL, params)
    assert before == ORIGINAL
    assert body["kv_transfer_params"] is params
    expected = {k: v for k, v in ORIGINAL.items() if k != "kv_transfer_params"}
    assert {k: v for k, v in body.items() if k != "kv_transfer_params"} == expected


def test_decode_body_drops_client_kv_params_when_connector_has_none():
    assert "kv_transfer_params" not in shaping.decode_body(ORIGINAL, None)


@pytest.mark.parametrize(
    ("header", "kept"),
    [
        ("abc-123", True),
        ("req_1.2:3", True),
        ("", False),
        (None, False),
        ("has space", False),
        ("x" * 129, False),
        ("-leading", False),
        ("new\nline", False),
    ],
)
def test_client_request_id(header, kept):
    rid = shaping.client_request_id(header)
    if kept:
        assert rid == header
    else:
        assert len(rid) == 32 and int(rid, 16) >= 0


def test_leg_headers():
    h = shaping.leg_headers("rid", "Bearer k", 1)
    assert h == {
        "Content-Type": "application/json",
        "X-Request-Id": "rid",
        "Authorization": "Bearer k",
        "X-data-parallel-rank": "1",
    }
    assert shaping.leg_headers("rid", None) == {
        "Content-Type": "application/json",
        "X-Request-Id": "rid",
    }
