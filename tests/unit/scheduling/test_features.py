from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdproxy.scheduling.features import (
    _ID_CHUNK,
    _MAX_BLOCKS,
    PARALLEL_SAMPLING,
    PROMPT_LOGPROBS,
    FeatureConfig,
    block_hashes,
    extract,
    one_leg_reason,
    render_prompt,
)

CONFIG = FeatureConfig(chars_per_token=4.0, block_chars=8)
LIMIT = CONFIG.block_chars * _MAX_BLOCKS  # what extract builds when it hashes blocks


def test_completion_prompt_is_estimated_in_tokens():
    f = extract({"model": "m", "prompt": "x" * 400}, None, CONFIG, want_blocks=False)
    assert (f.model, f.tokens, f.blocks) == ("m", 100.0, ())


def test_token_ids_count_exactly():
    text, _, tokens = render_prompt({"prompt": [1, 2, 3]}, LIMIT)
    assert tokens == 3 and text == "1,2,3"
    assert render_prompt({"prompt": [[1, 2], [3]]}, LIMIT).token_ids == 3
    assert render_prompt({"token_ids": [7] * 10}, 0) == ("", 0, 10)


def test_chat_renders_roles_and_text_parts_in_order():
    a = render_prompt({"messages": [{"role": "system", "content": "S"}]}, LIMIT).text
    b = render_prompt(
        {
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image"}]},
            ]
        },
        LIMIT,
    ).text
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
        # a chat's echo takes prompt logprobs of its top_logprobs, which is 0 when unset
        ({"messages": [], "echo": True}, PROMPT_LOGPROBS),
        ({"messages": [], "echo": True, "top_logprobs": 2}, PROMPT_LOGPROBS),
        ({"messages": [], "echo": False, "logprobs": True}, None),
        ({"token_ids": [1], "sampling_params": {"n": 2}}, PARALLEL_SAMPLING),
        ({"token_ids": [1], "sampling_params": {"prompt_logprobs": 1}}, PROMPT_LOGPROBS),
        # issue 19 row 7: the fields as vLLM coerces them, not by their JSON type
        ({"prompt": "p", "n": "2"}, PARALLEL_SAMPLING),
        ({"prompt": "p", "n": 2.0}, PARALLEL_SAMPLING),
        ({"prompt": "p", "n": " 3 "}, PARALLEL_SAMPLING),
        ({"prompt": "p", "n": "1"}, None),
        ({"prompt": "p", "best_of": "2"}, PARALLEL_SAMPLING),
        ({"prompt": "p", "use_beam_search": "true"}, PARALLEL_SAMPLING),
        ({"prompt": "p", "use_beam_search": "on"}, PARALLEL_SAMPLING),
        ({"prompt": "p", "use_beam_search": 1}, PARALLEL_SAMPLING),
        ({"prompt": "p", "use_beam_search": "false"}, None),
        ({"prompt": "p", "echo": "true", "logprobs": 1}, PROMPT_LOGPROBS),
        ({"prompt": "p", "echo": "yes", "logprobs": "1"}, PROMPT_LOGPROBS),
        ({"prompt": "p", "echo": True, "logprobs": False}, PROMPT_LOGPROBS),  # false is 0
        ({"prompt": "p", "echo": "false", "logprobs": 1}, None),
        ({"prompt": "p", "prompt_logprobs": "0"}, PROMPT_LOGPROBS),
        ({"messages": [], "echo": "1"}, PROMPT_LOGPROBS),
        ({"token_ids": [1], "sampling_params": {"n": "2"}}, PARALLEL_SAMPLING),
        # a token-in body is read from its sampling_params alone, as vLLM reads it
        ({"token_ids": [1], "n": 1, "sampling_params": {"n": 2}}, PARALLEL_SAMPLING),
        ({"token_ids": [1], "n": 2, "sampling_params": {}}, None),
    ],
)
def test_requests_vllm_cannot_split_across_two_legs(body, reason):
    assert one_leg_reason(body) == reason
    assert extract(body, None, CONFIG, want_blocks=False).one_leg == reason


def _reference_render(body: dict[str, Any]) -> tuple[str, int | None]:
    """render_prompt as it was before issue 19 (whole text, every id stringified): the
    prefix index's hashes of a prompt must not change."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        for message in messages:
            if not isinstance(message, dict):
                continue
            role = message.get("role")
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(
                    p["text"]
                    for p in content
                    if isinstance(p, dict) and isinstance(p.get("text"), str)
                )
            parts += [role if isinstance(role, str) else "", "\x1f"]
            parts += [content if isinstance(content, str) else "", "\x1e"]
        return "".join(parts), None
    prompt = body.get("prompt", body.get("token_ids"))
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return "\x1e".join(prompt), None
        if all(isinstance(t, int) for t in prompt):
            return ",".join(map(str, prompt)), len(prompt)
        if all(isinstance(p, list) for p in prompt):
            return "\x1e".join(",".join(map(str, p)) for p in prompt), sum(map(len, prompt))
    return "", None


_TEXT = st.text(alphabet="ab\x1e\x1f", max_size=40)
_IDS = st.lists(st.integers(0, 200_000), min_size=1, max_size=60)
_PROMPTS = st.one_of(
    st.builds(lambda p: {"prompt": p}, _TEXT),
    st.builds(lambda p: {"prompt": p}, st.lists(_TEXT, min_size=1, max_size=5)),
    st.builds(lambda p: {"prompt": p}, _IDS),
    st.builds(lambda p: {"token_ids": p}, _IDS),
    st.builds(lambda p: {"prompt": p}, st.lists(_IDS, min_size=1, max_size=4)),
    st.builds(
        lambda m: {"messages": m},
        st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["system", "user", 3]),
                    "content": st.one_of(
                        _TEXT,
                        st.none(),
                        st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _TEXT})),
                    ),
                }
            ),
            max_size=4,
        ),
    ),
)


@settings(max_examples=300, deadline=None)
@given(_PROMPTS, st.sampled_from([1, 3, 8]))
def test_block_hashes_are_today_s_for_every_well_formed_prompt(body, block_chars):
    """The bounded rendering is a prefix of the whole one (and measures it), so the hashes
    the prefix index sees do not change."""
    whole, ids = _reference_render(body)
    limit = block_chars * _MAX_BLOCKS
    rendered = render_prompt(body, limit)
    assert rendered.text == whole[:limit]
    assert rendered.token_ids == ids
    if ids is None:
        assert rendered.chars == len(whole)
    assert block_hashes(rendered.text, block_chars) == block_hashes(whole, block_chars)
    config = FeatureConfig(chars_per_token=4.0, block_chars=block_chars)
    features = extract(body, None, config, want_blocks=True)
    assert features.tokens == (ids if ids is not None else len(whole) / 4.0)
    assert extract(body, None, config, want_blocks=False).tokens == features.tokens


class _CountedId(int):
    """A token id that counts how often it is stringified."""

    made = 0

    def __str__(self) -> str:
        _CountedId.made += 1
        return super().__str__()


def test_a_huge_token_prompt_is_counted_not_stringified():
    """Issue 19 row 8: 15 M ids cost 7.5 s of event loop when every one was stringified.
    Only the ids the hashed text needs are (a chunk past it at most); the count is exact."""
    ids = [_CountedId(7)] * 3_000_000
    _CountedId.made = 0
    rendered = render_prompt({"prompt": ids}, LIMIT)
    assert rendered.token_ids == 3_000_000 and len(rendered.text) == LIMIT
    assert _CountedId.made <= LIMIT // 2 + _ID_CHUNK
    _CountedId.made = 0
    batch = render_prompt({"prompt": [ids, ids]}, LIMIT)
    assert batch.token_ids == 6_000_000 and _CountedId.made <= LIMIT // 2 + _ID_CHUNK
    _CountedId.made = 0
    assert extract({"prompt": ids}, None, CONFIG, want_blocks=False).tokens == 3_000_000
    assert _CountedId.made == 0  # nothing to hash: nothing stringified


def test_a_huge_text_prompt_is_measured_not_copied():
    text = "x" * 10_000_000
    for body in ({"prompt": text}, {"prompt": [text, text]}, {"messages": [{"content": text}]}):
        rendered = render_prompt(body, LIMIT)
        assert len(rendered.text) == LIMIT and rendered.chars >= len(text)
    parts = [{"type": "text", "text": text}] * 3
    assert render_prompt({"messages": [{"role": "u", "content": parts}]}, 0).chars == 30_000_003


def test_a_malformed_prompt_list_stops_at_the_first_item_of_another_form():
    assert render_prompt({"prompt": [1, 2, "x", 3]}, LIMIT) == ("1,2", 0, 4)
    assert render_prompt({"prompt": ["a", 1, "b"]}, LIMIT) == ("a", 1, None)
    assert render_prompt({"prompt": [[1], 2, [3]]}, LIMIT) == ("1", 0, 2)
    assert render_prompt({"prompt": [{"a": 1}]}, LIMIT) == ("", 0, None)
