import pytest

from pdproxy.scheduling.features import (
    PARALLEL_SAMPLING,
    PROMPT_LOGPROBS,
    FeatureConfig,
    block_hashes,
    extract,
    one_leg_reason,
    render_prompt,
)

CONFIG = FeatureConfig(chars_per_token=4.0, block_chars=8)


def test_completion_prompt_is_estimated_in_tokens():
    f = extract({"model": "m", "prompt": "x" * 400}, None, CONFIG, want_blocks=False)
    assert (f.model, f.tokens, f.blocks) == ("m", 100.0, ())


def test_token_ids_count_exactly():
    text, tokens = render_prompt({"prompt": [1, 2, 3]})
    assert tokens == 3 and text == "1,2,3"
    assert render_prompt({"prompt": [[1, 2], [3]]})[1] == 3


def test_chat_renders_roles_and_text_parts_in_order():
    a, _ = render_prompt({"messages": [{"role": "system", "content": "S"}]})
    b, _ = render_prompt(
        {
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image"}]},
            ]
        }
    )
    assert b.startswith(a) and "hi" in b


def test_session_from_header_then_user():
    body = {"prompt": "p", "user": "alice"}
    assert extract(body, "s1", CONFIG, want_blocks=False).session == "s1"
    assert extract(body, None, CONFIG, want_blocks=False).session == "alice"
    assert extract({"prompt": "p"}, None, CONFIG, want_blocks=False).session is None


def test_block_hashes_are_chained_so_shared_prefixes_share_leading_blocks():
    a = block_hashes("system prompt! question one", 8)
    b = block_hashes("system prompt! question two", 8)
    c = block_hashes("other prompt!! question one", 8)
    assert len(a) == 4 and a[:3] == b[:3] and a[3] != b[3]
    assert a[0] != c[0] and a[3] != c[3]  # same last block, different prefix


def test_garbage_bodies_give_empty_features():
    for body in ({}, {"prompt": 5}, {"messages": "x"}, {"messages": [1, None]}, {"prompt": []}):
        f = extract(body, None, CONFIG, want_blocks=True)
        assert f.tokens == 0 and f.blocks == ()


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"prompt": "p"}, None),
        ({"prompt": "p", "n": 1, "best_of": 1, "logprobs": 2, "echo": True}, PROMPT_LOGPROBS),
        ({"prompt": "p", "n": 2}, PARALLEL_SAMPLING),
        ({"prompt": "p", "best_of": 3}, PARALLEL_SAMPLING),
        ({"prompt": "p", "use_beam_search": True}, PARALLEL_SAMPLING),
        ({"prompt": "p", "n": True}, None),  # not a count
        ({"prompt": "p", "prompt_logprobs": 0}, PROMPT_LOGPROBS),
        ({"prompt": "p", "echo": True}, None),
        ({"prompt": "p", "logprobs": 3}, None),
        ({"messages": [], "echo": True, "logprobs": True}, None),  # chat: top_logprobs counts
        ({"messages": [], "echo": True, "top_logprobs": 2}, PROMPT_LOGPROBS),
        ({"prompt_token_ids": [1], "sampling_params": {"n": 2}}, PARALLEL_SAMPLING),
        ({"prompt_token_ids": [1], "sampling_params": {"prompt_logprobs": 1}}, PROMPT_LOGPROBS),
    ],
)
def test_requests_vllm_cannot_split_across_two_legs(body, reason):
    assert one_leg_reason(body) == reason
    assert extract(body, None, CONFIG, want_blocks=False).one_leg == reason
