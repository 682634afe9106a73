"""Tokenize once (``--render-once``): which text requests take the render → generate path,
and the ``/inference/v1/generate`` body they become. Pure: no I/O.

A ``/v1/completions`` or ``/v1/chat/completions`` request is rendered once (vLLM's
``/v1/completions/render`` or ``/v1/chat/completions/render``: tokenizer, chat template,
the request's ``SamplingParams``), and both legs then run on the token ids over
``/inference/v1/generate`` with ``output_mode: "text"``: the engine detokenizes exactly as
its OpenAI serving does (the same ``SamplingParams``, the same incremental detokenizer, the
same stop-string handling), and pdproxy puts the text into the OpenAI answer's shape
(``pdproxy.wire.derender``).

A request whose answer needs what only vLLM's OpenAI serving layer does after generation
goes the text path instead (``fallback_reason``), by design: tool calls and reasoning
(vLLM's parsers), logprobs (the OpenAI shapes' own token strings and offsets), echo and
prompt logprobs (the prompt's text and logprobs), several choices or prompts, and the
options that add fields generate does not report. The fields are read as vLLM reads them
(``pdproxy.wire.coerce``): ``n: "2"`` is two choices and ``echo: "false"`` no echo.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdproxy.types import ApiKind
from pdproxy.wire.coerce import read_bool, read_int
from pdproxy.wire.shaping import (
    MAX_TOKENS,
    SAMPLING_PARAMS,
    STREAM,
    STREAM_OPTIONS,
    TOKEN_IDS,
    JSONBody,
    is_streaming,
)

RENDER_PATHS = {
    ApiKind.COMPLETIONS: "/v1/completions/render",
    ApiKind.CHAT: "/v1/chat/completions/render",
}
TEXT = "text"
OUTPUT_MODE = "output_mode"
# vLLM serializes SamplingParams without the fields at their default; max_tokens' default
# is 16, so a rendered body without max_tokens means the serving layer computed 16.
SAMPLING_DEFAULT_MAX_TOKENS = 16

# Fields of the rendered GenerateRequest that go to /inference/v1/generate as they are.
_CARRIED = (
    "token_ids",
    "features",
    "model",
    "reasoning_ended",
    "cache_salt",
    "priority",
)

# Options whose answer the generate path cannot give byte for byte: the reason label.
_TOOLS = ("tools", "tool_choice", "functions", "function_call")
_STRUCTURED = ("response_format", "structured_outputs", "guided_json", "guided_regex")
_EXTRA_FIELDS = ("return_token_ids", "return_prompt_text", "return_tokens_as_token_ids")
_PROMPT_FORMS = ("suffix", "prompt_embeds")


def _truthy(body: Mapping[str, Any], keys: tuple[str, ...]) -> bool:
    return any(body.get(key) not in (None, False, [], {}, "") for key in keys)


def fallback_reason(kind: ApiKind, body: Mapping[str, Any]) -> str | None:
    """Why ``body`` must take the text path (a metric label), or None for render-once."""
    if _truthy(body, _TOOLS):
        return "tools"  # vLLM's tool parser shapes the message and the finish reason
    if _parallel(body):
        return "parallel_sampling"
    if _logprobs(kind, body):
        return "logprobs"  # the OpenAI shapes' own token strings, bytes and text offsets
    if read_bool(body.get("echo")) or read_int(body.get("prompt_logprobs"), None) is not None:
        return "echo"  # the prompt's text (and logprobs) go into the answer
    if _truthy(body, _STRUCTURED):
        return "structured_output"
    if _truthy(body, _EXTRA_FIELDS) or _truthy(body, _PROMPT_FORMS):
        return "unsupported_field"
    if kind is ApiKind.CHAT and not _assistant_turn(body):
        return "chat_role"  # the answer's role is the last message's
    options = body.get(STREAM_OPTIONS)
    if isinstance(options, Mapping) and read_bool(options.get("continuous_usage_stats")):
        return "continuous_usage"
    if kind is ApiKind.COMPLETIONS and not _one_prompt(body.get("prompt")):
        return "prompts"
    return None


def _parallel(body: Mapping[str, Any]) -> bool:
    n, best_of = read_int(body.get("n"), 1), read_int(body.get("best_of"), 1)
    return n > 1 or best_of > 1 or read_bool(body.get("use_beam_search"))


def _logprobs(kind: ApiKind, body: Mapping[str, Any]) -> bool:
    """A completion's ``logprobs`` is a count (0, or false read as 0, still asks for
    them); a chat's is a flag, and any ``top_logprobs`` goes the text path too."""
    if kind is ApiKind.CHAT:
        return read_bool(body.get("logprobs")) or body.get("top_logprobs") is not None
    return read_int(body.get("logprobs"), None) is not None


def _assistant_turn(body: Mapping[str, Any]) -> bool:
    return read_bool(body.get("add_generation_prompt"), True) and not read_bool(
        body.get("continue_final_message")
    )


def _one_prompt(prompt: Any) -> bool:
    """One prompt: a string, token ids (told by the first: vLLM refuses a mixed list, and a
    huge one is not walked), or a list holding one of those."""
    if isinstance(prompt, str):
        return True
    if isinstance(prompt, list) and prompt and type(prompt[0]) is int:
        return True
    return isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list))


def rendered_request(kind: ApiKind, answer: Any) -> Mapping[str, Any] | None:
    """The one GenerateRequest in a render answer (completions answer a list), or None
    when the answer is not one (several prompts, or not vLLM's shape)."""
    if kind is ApiKind.COMPLETIONS:
        if not isinstance(answer, list) or len(answer) != 1:
            return None
        answer = answer[0]
    if not isinstance(answer, Mapping):
        return None
    ids, params = answer.get(TOKEN_IDS), answer.get(SAMPLING_PARAMS)
    if not isinstance(ids, list) or not ids or not isinstance(params, Mapping):
        return None
    return answer


def rendered_fallback(rendered: Mapping[str, Any]) -> str | None:
    """A rendered request that needs the OpenAI serving layer after all: the renderer has
    a reasoning parser (it passes the parser's kwargs on), or it carries raw multimodal
    parts the decode would have to fetch again."""
    if rendered.get("reasoning_parser_kwargs") is not None:
        return "reasoning"
    if rendered.get("content_parts"):
        return "content_parts"
    return None


def generate_body(client: Mapping[str, Any], rendered: Mapping[str, Any]) -> JSONBody:
    """The ``/inference/v1/generate`` body for a rendered text request.

    The rendered ``sampling_params`` are the text path's own (vLLM's ``to_sampling_params``
    with the served limits applied), except that ``max_tokens`` is left out where it is
    16, its default: it is put back, since generate would otherwise fill in the room left
    in the context. ``stream`` (as vLLM reads it: ``"true"`` streams) and
    ``stream_options`` are the client's.
    """
    params = dict(rendered[SAMPLING_PARAMS])
    params.setdefault(MAX_TOKENS, SAMPLING_DEFAULT_MAX_TOKENS)
    params.pop("output_kind", None)  # generate sets it from stream
    body: JSONBody = {k: rendered[k] for k in _CARRIED if rendered.get(k) is not None}
    body[SAMPLING_PARAMS] = params
    body[OUTPUT_MODE] = TEXT
    stream = is_streaming(client)
    body[STREAM] = stream
    if stream and isinstance(client.get(STREAM_OPTIONS), Mapping):
        body[STREAM_OPTIONS] = dict(client[STREAM_OPTIONS])
    return body
