"""pdproxy.wire.coerce and pdproxy.wire.body_fields against pydantic itself (issue 19 row 7).

vLLM's request models are pydantic v2 models in lax mode; pdproxy mirrors the rules by hand
(no pydantic on the hot path). These tests run the mirror and pydantic on the same generated
values, so a pydantic upgrade that changes a rule fails here rather than in production.
Deterministic examples by default; ``PDPROXY_FUZZ_EXAMPLES=N`` runs N random ones per test.
"""

from __future__ import annotations

import math
import os
from typing import Annotated, Any

import pydantic
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, BeforeValidator, ConfigDict, model_validator

from pdproxy.errors import BadRequest
from pdproxy.types import ApiKind
from pdproxy.wire.body_fields import check_body
from pdproxy.wire.coerce import FieldError, lax_bool, lax_int, read_bool, read_int

INT = pydantic.TypeAdapter(int)
BOOL = pydantic.TypeAdapter(bool)
FUZZ_EXAMPLES = int(os.environ.get("PDPROXY_FUZZ_EXAMPLES", "0"))


def _settings(examples: int) -> settings:
    return settings(
        max_examples=FUZZ_EXAMPLES or examples,
        derandomize=not FUZZ_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )


SETTINGS = _settings(500)


def _pydantic(adapter: pydantic.TypeAdapter[Any], value: Any) -> tuple[Any, ...]:
    try:
        result = adapter.validate_python(value)
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        return ("refused", error["type"], error["msg"])
    return ("read", type(result), result)


def _mirror(function: Any, value: Any) -> tuple[Any, ...]:
    try:
        result = function(value)
    except FieldError as error:
        return ("refused", error.kind, error.message)
    return ("read", type(result), result)


# Rust's whitespace (pydantic trims it) and Python's extra isspace characters (it does not).
_SPACES = list("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2028\u3000\x1c\x1f\u200b\ufeff")
_PIECES = [
    "0",
    "1",
    "9",
    "00",
    "_",
    "__",
    "-",
    "+",
    ".",
    ".0",
    "e",
    "x",
    "\u0663",
    "\uff12",
    "t",
    "No",
]
_NUMBER_TEXT = st.lists(
    st.one_of(st.sampled_from(_PIECES + _SPACES), st.text("0123456789_.-+ e", max_size=4)),
    max_size=8,
).map("".join)
_LONG_NUMBERS = st.builds(
    lambda digits, before, after: before + "9" * digits + after,
    st.integers(4290, 4310),
    st.sampled_from(["", "-", "+", " ", "0", "-0"]),
    st.sampled_from(["", ".0", ".5", " ", "_", "e1"]),
)
_WORDS = st.builds(
    lambda word, flips: "".join(c.upper() if f else c for c, f in zip(word, flips, strict=False)),
    st.sampled_from(["true", "false", "yes", "no", "on", "off", "t", "f", "y", "n", "1", "0"]),
    st.lists(st.booleans(), min_size=5, max_size=5),
)
# What orjson can hand over (JSON values) plus the strings and floats that exercise pydantic's
# parsing: signs, underscores, ".0" fractions, whitespace, digit limits, i64 edges.
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.floats(min_value=-1e20, max_value=1e20).map(lambda f: float(round(f))),
    st.sampled_from([2.0**63, -(2.0**63), 2.0**63 - 1024, 1e19, -0.0, 9.2e18, math.inf]),
    st.text(max_size=12),
    _NUMBER_TEXT,
    _WORDS,
    _WORDS.map(lambda w: f" {w}"),
    st.from_regex(r"\s*[+-]?[0-9_]{0,25}(\.0*)?\s*", fullmatch=True),
    _LONG_NUMBERS,
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)
_EDGES = [
    "0" * 5000,
    " " * 5000 + "1",
    "0" + "9" * 4301,
    "1." + "0" * 5000,
    "0-1",
    "00-1",
    "0_-1",
    "-0-1",
    "0__0",
    "+0_1.00",
    "-0.0_0",
    "0.",
    "-",
    "",
    "İ",
    "\uff54rue",
    "1_000",
]


@SETTINGS
@given(VALUES)
def test_lax_int_is_pydantic_int(value):
    assert _mirror(lax_int, value) == _pydantic(INT, value)


@SETTINGS
@given(VALUES)
def test_lax_bool_is_pydantic_bool(value):
    assert _mirror(lax_bool, value) == _pydantic(BOOL, value)


@pytest.mark.parametrize("value", _EDGES)
def test_edge_strings(value):
    assert _mirror(lax_int, value) == _pydantic(INT, value)
    assert _mirror(lax_bool, value) == _pydantic(BOOL, value)


@pytest.mark.parametrize(
    ("value", "count", "flag"),
    [
        (2, 2, None),
        ("2", 2, None),
        (2.0, 2, None),
        ("2.0", 2, None),
        (" 2 ", 2, None),
        (True, 1, True),
        ("true", None, True),
        ("yes", None, True),
        ("on", None, True),
        ("1", 1, True),
        ("True", None, True),
        ("off", None, False),
        (0, 0, False),
        (2.5, None, None),
        ("two", None, None),
        ("maybe", None, None),
        ([], None, None),
    ],
)
def test_readers_give_the_read_value_or_the_default(value, count, flag):
    assert read_int(value, None) == count
    assert read_bool(value, default=None) is flag  # type: ignore[arg-type]
    assert read_int(None, 7) == 7 and read_bool(None, True) is True


# -- the field tables against vLLM 0.32's models -------------------------------------------


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


def _vllm_before_checks(data: Any, counts: tuple[str, ...]) -> Any:
    """vLLM's check_logprobs and validate_stream_options before-validators (copied rules)."""
    if not isinstance(data, dict):
        return data
    for name in counts:
        value = data.get(name)
        if value is not None and not isinstance(value, (int, float)):
            raise ValueError(f"`{name}` must be an integer.")
    if data.get("stream_options") and not data.get("stream"):
        raise ValueError("Stream options can only be defined when `stream=True`.")
    return data


class _Completion(BaseModel):
    """vLLM 0.32's CompletionRequest, the fields pdproxy decides on (same annotations)."""

    model_config = ConfigDict(extra="allow")
    n: int = 1
    use_beam_search: bool = False
    echo: bool | None = False
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _before(cls, data: Any) -> Any:
        return _vllm_before_checks(data, ("prompt_logprobs", "logprobs"))


class _Chat(BaseModel):
    """vLLM 0.32's ChatCompletionRequest, the fields pdproxy decides on."""

    model_config = ConfigDict(extra="allow")
    n: int | None = 1
    use_beam_search: bool = False
    echo: bool = False
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, BeforeValidator(lambda v: 0 if v is None else v)] = 0
    prompt_logprobs: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    min_tokens: int = 0
    user: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="before")
    @classmethod
    def _before(cls, data: Any) -> Any:
        return _vllm_before_checks(data, ("prompt_logprobs", "top_logprobs"))


_FIELD_VALUES = st.one_of(
    st.sampled_from([None, True, False, 0, 1, 2, 2.0, 2.5, -1, "2", "2.0", " 3 ", "1_0"]),
    st.sampled_from(["true", "false", "yes", "off", "1", "0", "two", "maybe", "", [], {}]),
    VALUES,
)
_OPTIONS = st.one_of(
    st.none(),
    _FIELD_VALUES,
    st.dictionaries(st.sampled_from(["include_usage", "continuous_usage_stats"]), _FIELD_VALUES),
)


def _bodies(model: type[BaseModel]) -> st.SearchStrategy[dict[str, Any]]:
    names = [n for n in model.model_fields if n != "stream_options"]
    fields = {n: _FIELD_VALUES for n in names} | {"stream_options": _OPTIONS}
    return st.fixed_dictionaries({}, optional=fields)


def _agree(kind: ApiKind, model: type[BaseModel], body: dict[str, Any]) -> None:
    try:
        read = model.model_validate(body)
    except pydantic.ValidationError:
        read = None
    try:
        check_body(kind, body)
    except BadRequest as refused:
        assert read is None, f"pdproxy refused what vLLM reads: {refused.message}"
        return
    assert read is not None, "pdproxy accepted what vLLM refuses"
    # and the decisions read each field as vLLM did
    for name, value in body.items():
        if name == "stream_options":
            continue
        expected = getattr(read, name)
        if isinstance(expected, bool):
            assert read_bool(value, expected) is expected, name
        elif isinstance(expected, int):
            assert read_int(value, expected) == expected, name


@_settings(250)
@given(_bodies(_Completion))
@example({"n": "2"})
@example({"n": None})
@example({"logprobs": "1"})
@example({"stream_options": {"include_usage": "maybe"}, "stream": "yes"})
@example({"stream_options": {"include_usage": True}, "stream": "false"})
def test_completions_bodies_are_refused_exactly_where_vllm_refuses_them(body):
    _agree(ApiKind.COMPLETIONS, _Completion, body)


@_settings(250)
@given(_bodies(_Chat))
@example({"n": None, "echo": "true", "top_logprobs": None})
@example({"echo": None})
@example({"top_logprobs": "2"})
def test_chat_bodies_are_refused_exactly_where_vllm_refuses_them(body):
    _agree(ApiKind.CHAT, _Chat, body)


@pytest.mark.parametrize(
    ("kind", "body", "param", "kind_of_error"),
    [
        (ApiKind.COMPLETIONS, {"n": 2.5}, "n", "int_from_float"),
        (ApiKind.COMPLETIONS, {"n": "two"}, "n", "int_parsing"),
        (ApiKind.COMPLETIONS, {"n": None}, "n", "int_type"),
        (ApiKind.CHAT, {"stream": "maybe"}, "stream", "bool_parsing"),
        (ApiKind.CHAT, {"stream": True, "stream_options": {"include_usage": 2}}, None, None),
        (ApiKind.GENERATE, {"sampling_params": {"n": "2x"}}, "sampling_params.n", "int_parsing"),
        (ApiKind.GENERATE, {"stream": [], "sampling_params": {}}, "stream", "bool_type"),
    ],
)
def test_a_refusal_is_vllms_400(kind, body, param, kind_of_error):
    with pytest.raises(BadRequest) as refused:
        check_body(kind, body)
    error = refused.value.to_dict()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    if param is None:
        assert error["param"] == "stream_options.include_usage"
        return
    assert error["param"] == param
    assert error["message"].startswith("1 validation error:\n  {'type': ")
    assert f"'type': '{kind_of_error}'" in error["message"]
    assert f"'loc': 'body.{param}'" in error["message"]


def test_vllms_own_checks_keep_vllms_words():
    with pytest.raises(BadRequest) as refused:
        check_body(ApiKind.COMPLETIONS, {"logprobs": "2"})
    assert (refused.value.message, refused.value.param) == (
        "`logprobs` must be an integer.",
        "logprobs",
    )
    with pytest.raises(BadRequest) as refused:
        check_body(ApiKind.CHAT, {"stream_options": {"include_usage": True}})
    assert refused.value.param == "stream_options"
    check_body(ApiKind.GENERATE, {"stream_options": {"include_usage": True}, "sampling_params": {}})


def test_the_refused_input_is_echoed_bounded():
    with pytest.raises(BadRequest) as refused:
        check_body(ApiKind.COMPLETIONS, {"n": "x" * 100_000})
    assert len(refused.value.message) < 500 and "...[truncated]" in refused.value.message
    with pytest.raises(BadRequest) as refused:
        check_body(ApiKind.COMPLETIONS, {"user": list(range(100_000))})
    assert "<list of 100000 items>" in refused.value.message


def test_fields_vllm_does_not_have_are_never_refused():
    # best_of is no field of vLLM 0.32 (it is ignored); max_completion_tokens only a chat's
    check_body(ApiKind.COMPLETIONS, {"best_of": "many", "max_completion_tokens": "x"})
    check_body(ApiKind.GENERATE, {"n": "x", "echo": "x", "sampling_params": {"best_of": "x"}})
