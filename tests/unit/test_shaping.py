import copy

import pytest

from pdproxy.wire import shaping

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


TOKEN_IN = {
    "model": "m",
    "token_ids": [1, 2, 3],
    "sampling_params": {"max_tokens": 50, "min_tokens": 5, "temperature": 0, "stop": ["x"]},
    "stream": True,
    "stream_options": {"include_usage": True},
    "kv_transfer_params": {"remote_host": "evil"},
}


def test_token_in_prefill_is_clamped_in_its_sampling_params():
    before = copy.deepcopy(TOKEN_IN)
    body = shaping.prefill_body(TOKEN_IN, {"do_remote_decode": True})
    assert before == TOKEN_IN
    # min_tokens 5 > max_tokens 1 would be refused: the minimum is the one token (EOS masked,
    # no stop string at it: the client's first token, as --first-token-from-prefill sends it)
    params = {"max_tokens": 1, "min_tokens": 1, "temperature": 0, "stop": ["x"]}
    assert body["sampling_params"] == params
    assert "max_tokens" not in body and "max_completion_tokens" not in body
    assert body["stream"] is False and "stream_options" not in body
    assert body["kv_transfer_params"] == {"do_remote_decode": True}
    assert body["token_ids"] == [1, 2, 3]


def test_token_in_decode_is_the_original_with_the_connectors_params():
    params = {"remote_engine_id": "e", "remote_prefill_cached_tokens": 32}
    body = shaping.decode_body(TOKEN_IN, params)
    assert body["kv_transfer_params"] is params  # forwarded untouched: usage stays true
    assert body["sampling_params"] == TOKEN_IN["sampling_params"]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    ("body", "kind"),
    [
        (TOKEN_IN, shaping.ApiKind.GENERATE),
        ({"model": "m", "messages": []}, shaping.ApiKind.CHAT),
        ({"model": "m", "prompt": "p"}, shaping.ApiKind.COMPLETIONS),
        # token ids without a sampling_params object are not a generate body
        ({"model": "m", "token_ids": [1], "sampling_params": None}, shaping.ApiKind.COMPLETIONS),
    ],
)
def test_body_kind(body, kind):
    assert shaping.body_kind(body) is kind


@pytest.mark.parametrize(
    ("stream", "streams"),
    [
        (True, True),
        ("true", True),
        ("True", True),
        ("yes", True),
        ("1", True),
        (1, True),
        (False, False),
        (None, False),
        ("false", False),
        ("maybe", False),
        (2, False),
    ],
)
def test_a_stream_is_what_vllm_reads_as_one(stream, streams):
    """Issue 19 row 7: ``stream: "true"`` streams on vLLM, so it is a stream here too (a
    value vLLM refuses never gets this far on the generation endpoints)."""
    assert shaping.is_streaming({"stream": stream}) is streams
    assert shaping.is_streaming({}) is False


def test_include_usage_is_read_as_vllm_reads_it():
    assert shaping.includes_usage({"stream_options": {"include_usage": "true"}}) is True
    assert shaping.includes_usage({"stream_options": {"include_usage": "0"}}) is False
    assert not shaping.includes_usage({"stream_options": "x"})
    assert not shaping.includes_usage({})
