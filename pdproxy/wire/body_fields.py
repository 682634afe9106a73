"""The body fields pdproxy decides on, with vLLM 0.32's types: a value vLLM would refuse
is refused here (``check_body``: 400, before any leg), in vLLM's words.

The fields are those pdproxy reads (``n``, ``best_of``... in ``scheduling.features`` and
``tokenize_once``, ``stream`` in ``shaping``) or rewrites on a prefill leg (``max_tokens``,
``min_tokens``, ``stream_options``): a prefill must not accept a request that its decode
would then refuse. Each is typed as in ``CompletionRequest``, ``ChatCompletionRequest`` and
``GenerateRequest`` (with its ``SamplingParams``), and converted by ``pdproxy.wire.coerce``'s
mirror of pydantic's lax mode. The body is never changed: the engines get the client's own
values and read them their way. ``best_of`` is no field of vLLM 0.32 (it ignores it), so it
is never refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from pdproxy.errors import BadRequest
from pdproxy.types import ApiKind
from pdproxy.wire.coerce import STRING_TYPE, FieldError, lax_bool, lax_int

_MODEL_TYPE = "model_type"
_VALUE_ERROR = "value_error"  # one of vLLM's own before-validators refused the value


class _Spec(NamedTuple):
    exact: type | None  # a value of exactly this type needs no parsing
    nullable: bool
    parse: Callable[[Any], object]  # raises FieldError


def _logprobs_count(name: str) -> Callable[[Any], object]:
    """vLLM's ``check_logprobs`` before-validator: a number (or null), never a string."""
    message = (_VALUE_ERROR, f"`{name}` must be an integer.")

    def parse(value: Any) -> object:
        if not isinstance(value, (int, float)):
            raise FieldError(message)
        return lax_int(value)

    return parse


def _string(value: Any) -> object:
    raise FieldError(STRING_TYPE)  # only a str passes, and it never gets here


INT = _Spec(int, False, lax_int)
OPT_INT = _Spec(int, True, lax_int)
BOOL = _Spec(bool, False, lax_bool)
OPT_BOOL = _Spec(bool, True, lax_bool)
OPT_STR = _Spec(str, True, _string)

_STREAM_OPTIONS_FIELDS = {"include_usage": OPT_BOOL, "continuous_usage_stats": OPT_BOOL}


def _stream_options(value: Any) -> object:
    if not isinstance(value, Mapping):
        raise FieldError(
            (_MODEL_TYPE, "Input should be a valid dictionary or instance of StreamOptions")
        )
    _check_fields(value, _STREAM_OPTIONS_FIELDS, "stream_options.")
    return value


OPT_STREAM_OPTIONS = _Spec(None, True, _stream_options)

# vLLM 0.32's field types (CompletionRequest, ChatCompletionRequest, GenerateRequest and
# its SamplingParams) for the fields pdproxy reads or rewrites on a leg.
_COMMON = {
    "use_beam_search": BOOL,
    "stream": OPT_BOOL,
    "stream_options": OPT_STREAM_OPTIONS,
    "prompt_logprobs": _Spec(int, True, _logprobs_count("prompt_logprobs")),
    "max_tokens": OPT_INT,
    "min_tokens": INT,
    "user": OPT_STR,
}
COMPLETION_FIELDS: Mapping[str, _Spec] = {
    **_COMMON,
    "n": INT,
    "echo": OPT_BOOL,
    "logprobs": _Spec(int, True, _logprobs_count("logprobs")),
}
CHAT_FIELDS: Mapping[str, _Spec] = {
    **_COMMON,
    "n": OPT_INT,
    "echo": BOOL,
    "logprobs": OPT_BOOL,
    "top_logprobs": _Spec(int, True, _logprobs_count("top_logprobs")),  # null means 0
    "max_completion_tokens": OPT_INT,
    "add_generation_prompt": BOOL,
    "continue_final_message": BOOL,
}
SAMPLING_FIELDS: Mapping[str, _Spec] = {
    "n": INT,
    "max_tokens": OPT_INT,
    "min_tokens": INT,
    "logprobs": OPT_INT,
    "prompt_logprobs": OPT_INT,
}


def _sampling_params(value: Any) -> object:
    if isinstance(value, Mapping):  # pdproxy refuses a non-object before this check
        _check_fields(value, SAMPLING_FIELDS, "sampling_params.")
    return value


GENERATE_FIELDS: Mapping[str, _Spec] = {
    "stream": OPT_BOOL,
    "stream_options": OPT_STREAM_OPTIONS,
    "sampling_params": _Spec(None, False, _sampling_params),
}
_MISSING = object()


class _Refused(Exception):
    def __init__(self, path: str, value: Any, error: FieldError) -> None:
        super().__init__(path)
        self.path, self.value, self.error = path, value, error


def check_body(kind: ApiKind, body: Mapping[str, Any]) -> None:
    """Raise ``BadRequest`` (400, the field named in ``param``) when vLLM would refuse one
    of the fields pdproxy decides on; the body is left as it is."""
    # (identity tests: an Enum's hash is a Python call, and this runs on every request)
    if kind is ApiKind.COMPLETIONS:
        fields = COMPLETION_FIELDS
    elif kind is ApiKind.CHAT:
        fields = CHAT_FIELDS
    elif kind is ApiKind.GENERATE:
        fields = GENERATE_FIELDS
    else:
        return
    try:
        _check_fields(body, fields, "")
    except _Refused as refused:
        raise _bad_request(refused) from None
    if kind is not ApiKind.GENERATE and body.get("stream_options") and not body.get("stream"):
        # vLLM's validate_stream_options, on the raw values as vLLM tests them
        raise BadRequest(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )


def _check_fields(body: Mapping[str, Any], fields: Mapping[str, _Spec], prefix: str) -> None:
    # Walk the shorter of the two: a usual body has a handful of keys, a hostile one may
    # have millions, and a typed value costs a lookup and a type test either way.
    for name in body if len(body) <= len(fields) else fields:
        spec = fields.get(name)
        value = body.get(name, _MISSING)
        if spec is None or value is _MISSING or type(value) is spec.exact:
            continue
        if value is None and spec.nullable:
            continue
        try:
            spec.parse(value)
        except FieldError as error:
            raise _Refused(prefix + name, value, error) from None


def _bad_request(refused: _Refused) -> BadRequest:
    """vLLM's 400 for a refused field: one validation error, its input bounded."""
    error = refused.error
    if error.kind == _VALUE_ERROR:
        return BadRequest(error.message, param=refused.path)
    detail = {
        "type": error.kind,
        "loc": f"body.{refused.path}",
        "msg": error.message,
        "input": _summary(refused.value),
    }
    return BadRequest(f"1 validation error:\n  {detail}", param=refused.path)


def _summary(value: Any) -> object:
    """The refused input as vLLM echoes it: at most 200 characters, containers described."""
    if isinstance(value, (list, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    if isinstance(value, str):
        return value if len(value) <= 200 else value[:200] + "...[truncated]"
    try:
        text = repr(value)
    except ValueError:  # an int past CPython's digit limit
        return f"<{type(value).__name__}>"
    return value if len(text) <= 200 else text[:200] + "...[truncated]"
