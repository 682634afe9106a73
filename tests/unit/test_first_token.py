"""pdproxy.wire.first_token: which streams take the prefill's token, its chunk, the decode's
body after it, the usage put back, and the block-size bounds."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from pdproxy.wire import first_token as ft

BODY: dict[str, Any] = {
    "model": "m",
    "token_ids": [1, 2, 3],
    "sampling_params": {"max_tokens": 8, "min_tokens": 2, "temperature": 0},
    "stream": True,
    "stream_options": {"include_usage": True},
}
ANSWER: dict[str, Any] = {
    "request_id": "generate-tokens-r",
    "usage": {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1,
              "prompt_tokens_details": {"cached_tokens": 0, "multimodal_tokens": None}},
    "kv_transfer_params": {"remote_engine_id": "p", "remote_num_tokens": 3,
                           "remote_block_ids": [[7]]},
    "choices": [{"index": 0, "finish_reason": "length", "stop_reason": None,
                 "token_ids": [42]}],
}  # fmt: skip


def _with(**params: Any) -> dict[str, Any]:
    return {**BODY, "sampling_params": {**BODY["sampling_params"], **params}}


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (BODY, None),
        ({**BODY, "stream": False}, "not_token_in_stream"),
        ({"model": "m", "prompt": "x", "stream": True}, "not_token_in_stream"),
        (_with(n=2), "parallel_sampling"),
        (_with(n="2"), "parallel_sampling"),
        (_with(logprobs=0), "output_bound"),  # 0 still returns the sampled token's
        (_with(presence_penalty=0), None),
        (_with(prompt_logprobs=1), "output_bound"),
        (_with(frequency_penalty=0.1), "output_bound"),
        (_with(structured_outputs={"json": {}}), "output_bound"),
        ({**BODY, "return_token_ids": True}, "prompt_reported"),
        ({**BODY, "stream_options": {"continuous_usage_stats": True}}, "continuous_usage"),
        (_with(max_tokens="8"), "limits"),
    ],
)
def test_reason(body, why):
    assert ft.reason(body) == why


def test_first_chunk_has_the_decodes_shape():
    token = ft.first_token(BODY, ANSWER)
    assert token is not None and token.finish_reason is None and token.token == 42
    chunk = ft.first_chunk(token)
    assert chunk == (
        b'data: {"request_id":"generate-tokens-r","usage":null,"output_mode":"tokens",'
        b'"choices":[{"index":0,"finish_reason":null,"stop_reason":null,"token_ids":[42],'
        b'"routed_experts":null,"sampling_mask":null,"weight_versions":null,"logprobs":null}]}'
        b"\n\n"
    )


def test_a_stop_at_t1_is_the_whole_stream_with_the_prefills_usage():
    answer = {**ANSWER, "choices": [{**ANSWER["choices"][0], "finish_reason": "stop"}]}
    token = ft.first_token(BODY, answer)
    assert token is not None and token.finish_reason == "stop"
    events = ft.ended_stream(token, include_usage=True).split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    usage = orjson.loads(events[1][6:])
    assert usage["usage"] == {
        "prompt_tokens": 3,
        "total_tokens": 4,
        "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_max_tokens_one_ends_at_the_prefill_and_other_lengths_go_on():
    assert ft.first_token(_with(max_tokens=1), ANSWER).finish_reason == "length"  # type: ignore[union-attr]
    assert ft.first_token(BODY, ANSWER).finish_reason is None  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "choice",
    [
        {"finish_reason": "abort", "token_ids": [1]},
        {"finish_reason": "length", "token_ids": [1, 2]},
        {"finish_reason": "length", "token_ids": []},
        {"finish_reason": "length", "token_ids": [1], "text": "\ufffd"},
    ],
)
def test_an_answer_not_of_one_clean_token_keeps_the_usual_path(choice):
    assert ft.first_token(BODY, {**ANSWER, "choices": [choice]}) is None


def test_the_decode_continues_after_t1_one_token_shorter():
    body = ft.continued_body(BODY, 42)
    assert body["token_ids"] == [1, 2, 3, 42] and BODY["token_ids"] == [1, 2, 3]
    assert body["sampling_params"] == {"max_tokens": 7, "min_tokens": 1, "temperature": 0}
    absent = ft.continued_body({**BODY, "sampling_params": {}}, 42)
    assert absent["sampling_params"] == {}  # the room left in the context: one less by itself


def test_usage_is_put_back_to_the_clients_request():
    chunk = (
        b'data: {"request_id":"r","usage":null,"choices":[{"token_ids":[5]}]}\n\n'
        b'data: {"request_id":"r","usage":{"prompt_tokens":4,"total_tokens":9,'
        b'"completion_tokens":5},"output_mode":"tokens","choices":[]}\n\ndata: [DONE]\n\n'
    )
    fixed = ft.fix_usage(chunk)
    assert fixed == chunk.replace(b'"prompt_tokens":4', b'"prompt_tokens":3').replace(
        b'"completion_tokens":5', b'"completion_tokens":6'
    )
    token_chunk = b'data: {"usage":null,"choices":[]}\n\n'
    assert ft.fix_usage(token_chunk) is token_chunk


def test_block_size_bounds_tell_the_edge():
    sizes = ft.BlockSizes()
    assert sizes.on_edge("p", 64, 2)  # unknown: 32 might be it
    assert not sizes.on_edge("p", 65, 3)  # never a multiple of its block count
    sizes.observe("p", 65, 3)  # B in 22..32
    assert sizes.size("p") == (22, 32)
    sizes.observe("p", 64, 2)  # B in 32..63
    assert sizes.size("p") == (32, 32)
    assert sizes.on_edge("p", 96, 3) and not sizes.on_edge("p", 90, 3)  # 30 is not 32
    sizes.observe("p", 10, 1)
    assert sizes.size("p") == (32, 32)
    sizes.observe("p", 100, 1)  # inconsistent (restarted with another size): start again
    assert sizes.size("p") == (100, None)


def test_held_blocks_reads_the_nixl_params():
    assert ft.held_blocks(ANSWER) == ("p", 3, 1)
    flat = {"kv_transfer_params": {**ANSWER["kv_transfer_params"], "remote_block_ids": [1, 2]}}
    assert ft.held_blocks(flat) == ("p", 3, 2)
    groups = {
        "kv_transfer_params": {**ANSWER["kv_transfer_params"], "remote_block_ids": [[1], [2]]}
    }
    assert ft.held_blocks(groups) is None
    assert ft.held_blocks({}) is None


async def test_a_stream_whose_decode_leg_was_given_up_fails_rather_than_cancels():
    """The watchdog or a drain closes the relay while the decode leg is opening: the reader
    gets the leg's failure (an error event), not a cancellation of its own task."""
    import asyncio

    from pdproxy.errors import UpstreamError
    from pdproxy.proxying.first_token import _Spliced

    opening: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    spliced = _Spliced(b"data: {}\n\n", opening)
    assert await spliced.read_chunk() == b"data: {}\n\n"
    reading = asyncio.ensure_future(spliced.read_chunk())
    await asyncio.sleep(0)
    spliced.close()
    with pytest.raises(UpstreamError):
        await reading


def _transfer(url: str) -> Any:
    from types import SimpleNamespace

    prefill = SimpleNamespace(url=url)
    decision = SimpleNamespace(prefill=prefill, prefill_dp_rank=None)
    return SimpleNamespace(decision=decision, request_id="r")


def _answer(engine: str, tokens: int, blocks: int) -> dict[str, Any]:
    params = {"remote_engine_id": engine, "remote_num_tokens": tokens,
              "remote_block_ids": [list(range(blocks))]}  # fmt: skip
    return {**ANSWER, "kv_transfer_params": params}


def _path() -> tuple[Any, list[tuple[str, str]]]:
    from types import SimpleNamespace

    from pdproxy.proxying.first_token import FirstTokenPath

    failures: list[tuple[str, str]] = []
    legs = SimpleNamespace(count_failure=lambda e, why: failures.append((e.url, why)))
    return FirstTokenPath(legs=legs, release=SimpleNamespace()), failures  # type: ignore[arg-type]


def _request(tokens: int) -> Any:
    from pdproxy.proxying.exchange import ClientRequest
    from pdproxy.types import ApiKind

    return ClientRequest(ApiKind.GENERATE, {**BODY, "token_ids": list(range(tokens))}, None, None)


def test_what_is_learned_is_the_instances_never_the_engine_id_it_claims():
    # Issue 29: a prefill claiming a legitimate prefill's engine id narrowed its bounds, and
    # the legitimate prefill's next request on the block edge took the fast path (and
    # killed a vLLM 0.32 decode).
    path, _ = _path()
    good, bad = _transfer("http://good:1"), _transfer("http://bad:1")
    for tokens, blocks in ((33, 3), (32, 2)):  # good: 16-token blocks, learned
        path._first_token(_request(tokens), good, _answer("E", tokens, blocks))
    path._first_token(_request(64), bad, _answer("E", 64, 1))  # "E" with 64-token blocks
    # good's prompt of 32 tokens in 2 blocks sits on its edge: the usual decode
    assert path._first_token(_request(32), good, _answer("E", 32, 2)) is None
    assert path._blocks.size("http://good:1|0") == (16, 16)


def test_a_prefill_listing_too_few_blocks_is_not_trusted_and_counts_as_failed():
    path, failures = _path()
    good = _transfer("http://good:1")
    path._first_token(_request(33), good, _answer("E", 33, 3))  # blocks of 11..16
    assert path._first_token(_request(48), good, _answer("E", 48, 2)) is None  # needs 3
    assert failures == [("http://good:1", "too_few_blocks")]
    assert path._first_token(_request(5000), good, _answer("E", 5000, 1)) is None
    assert len(failures) == 2 and path._blocks.size("http://good:1|0") == (11, 16)
