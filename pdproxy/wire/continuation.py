"""A cut stream's continuation, in pure formats: what a stream delivered before it was cut,
the request that continues it on another decode, and the continuation's events rewritten
so that the client sees one stream.

The continuation of a request is the same request with what was generated so far appended
to its prompt: token ids on the token-in path (``/inference/v1/generate``, and so under
``--render-once``), exact; the prompt text for completions; for chat, the assistant message
continued (vLLM's ``continue_final_message``, ``add_generation_prompt`` off). ``max_tokens``
and ``min_tokens`` shrink by the tokens already generated, and a seed is derived from the
original (``continued_seed``). ``continuation_body`` takes any prompt ids and generated ids,
so a first token made elsewhere (issue 21) can be continued the same way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from pdproxy.types import ApiKind
from pdproxy.wire.coerce import read_bool, read_int
from pdproxy.wire.shaping import (
    MAX_COMPLETION_TOKENS,
    MAX_TOKENS,
    MESSAGES,
    MIN_TOKENS,
    PROMPT,
    REQUEST_ID,
    SAMPLING_PARAMS,
    TOKEN_IDS,
)

_DATA = b"data: "
_ENGINE_ERROR = b'data: {"error"'  # vLLM's mid-stream error event (a token's: {"id")
_ERROR_ENDS = (b"}}\n\n", b"[DONE]\n\n")  # how a read with one ends (vLLM: then [DONE])
_EVENT_END = b"\n\n"
_DONE = b"[DONE]"
# The fields that say which response a chunk belongs to; the continuation's take the
# original's values.
_IDENTITY = ("id", REQUEST_ID, "created", "model", "system_fingerprint")
# Structured output: the grammar's state at the cut cannot be handed to another engine.
_STRUCTURED = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
    "guided_decoding",
)
# A chat delta that is not plain content (tool calls, reasoning) comes from a parser whose
# state cannot be resumed.
_PLAIN_DELTA = frozenset({"role", "content"})


# Every field ``not_migratable`` reads: a body with none of them (the usual one) is decided
# by one set intersection.
_CHECKED = frozenset(
    {"n", "best_of", "logprobs", "top_logprobs", "prompt_logprobs", "echo", "return_token_ids"}
    | {"response_format", "tools", *_STRUCTURED}
)


_GENERATE, _COMPLETIONS = ApiKind.GENERATE, ApiKind.COMPLETIONS  # once per request: no lookups


def not_migratable(kind: ApiKind, body: Mapping[str, Any]) -> str | None:
    """Why a streamed request's continuation could not be exact in kind (None: it can)."""
    options = body.get(SAMPLING_PARAMS) if kind is _GENERATE else body
    if not isinstance(options, Mapping):
        return "body"
    if _CHECKED.isdisjoint(body) and (options is body or _CHECKED.isdisjoint(options)):
        if kind is _COMPLETIONS and _prompt_text(body.get(PROMPT)) is None:
            return "prompt"
        return None
    if (read_int(options.get("n"), 1) or 1) > 1 or (read_int(options.get("best_of"), 1) or 1) > 1:
        return "n"
    if _asks_logprobs(kind, options) or options.get("prompt_logprobs") is not None:
        return "logprobs"
    if read_bool(body.get("echo")) or read_bool(body.get("return_token_ids")):
        return "echo"
    if any(options.get(key) is not None for key in _STRUCTURED) or _response_format(body):
        return "structured_output"
    if kind is ApiKind.CHAT and body.get("tools") and body.get("tool_choice") != "none":
        return "tools"
    if kind is ApiKind.COMPLETIONS and _prompt_text(body.get(PROMPT)) is None:
        return "prompt"
    return None


def _asks_logprobs(kind: ApiKind, options: Mapping[str, Any]) -> bool:
    if kind is ApiKind.CHAT:
        return read_bool(options.get("logprobs")) or options.get("top_logprobs") is not None
    return options.get("logprobs") is not None


def _response_format(body: Mapping[str, Any]) -> bool:
    fmt = body.get("response_format")
    return isinstance(fmt, Mapping) and fmt.get("type") not in (None, "text")


def _prompt_text(prompt: Any) -> str | None:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt if isinstance(prompt, str) else None


@dataclass(slots=True)
class Generated:
    """What the client received of an answer so far: its text (text paths) or token ids
    (token-in), the tokens counted, and the identity fields of its first chunk."""

    text: str = ""  # the text it started with; what came after is in ``parts``
    token_ids: list[int] = field(default_factory=list)
    tokens: int = 0
    identity: dict[str, Any] = field(default_factory=dict)
    # the text's pieces as they came: joined once, when a continuation needs the whole
    # (``+=`` on every fold copied the text so far: quadratic in a long stream)
    parts: list[str] = field(default_factory=list)

    def whole_text(self) -> str:
        if self.parts:
            self.text += "".join(self.parts)
            self.parts.clear()
        return self.text

    # the engine's own count of this leg's completion tokens, from a chunk's usage (where
    # the client asked continuous usage stats): vLLM packs several tokens into one chunk
    # under load or speculative decoding, so a chunk is not a token
    leg_tokens: int | None = None

    def count(self) -> int:
        """This leg's tokens: the engine's count where it gave one, else its chunks."""
        return self.tokens if self.leg_tokens is None else max(self.leg_tokens, 0)

    def extend(self, more: Generated) -> None:
        """``more`` of the same leg (a fold, then the rest)."""
        if more.text:
            self.parts.append(more.text)
        self.parts.extend(more.parts)
        self.token_ids.extend(more.token_ids)
        self.tokens += more.tokens
        if more.leg_tokens is not None:
            self.leg_tokens = more.leg_tokens  # cumulative within the leg
        if not self.identity:
            self.identity = more.identity

    def add_leg(self, leg: Generated) -> None:
        """A whole leg's ``Generated``, after those before it: the counts add up."""
        tokens = leg.count()
        leg.leg_tokens = None
        self.extend(leg)
        self.tokens += tokens - leg.tokens


def read_generated(kind: ApiKind, stream: bytes) -> Generated | None:
    """What ``stream`` (an engine's SSE bytes as the client received them) delivered; None
    when it cannot be continued: cut inside an event, an event not understood (an error,
    tool calls, reasoning, another choice), or an answer that already finished.

    The text paths count one token per chunk with text, as vLLM streams them (one engine
    step each); the token-in path counts its ids.
    """
    if stream and not stream.endswith(_EVENT_END):
        return None  # the client saw part of an event: nothing can complete it
    generated = Generated()
    for event in stream.split(_EVENT_END):
        if not event:
            continue
        if not event.startswith(_DATA) or event[len(_DATA) :] == _DONE:
            return None
        try:
            data = orjson.loads(event[len(_DATA) :])
        except orjson.JSONDecodeError:
            return None
        if not isinstance(data, dict) or not _read_event(kind, data, generated):
            return None
    return generated


def _read_event(kind: ApiKind, data: dict[str, Any], generated: Generated) -> bool:
    if not generated.identity:
        generated.identity = {k: data[k] for k in _IDENTITY if k in data}
    choices = data.get("choices")
    if not isinstance(choices, list) or "error" in data:
        return False
    usage = data.get("usage")
    if isinstance(usage, dict):
        counted = usage.get("completion_tokens")
        if type(counted) is int and 0 <= counted < 1 << 31:
            generated.leg_tokens = counted
    for choice in choices:
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            return False
        if choice.get("finish_reason") is not None:
            return False  # finished: only its usage or [DONE] was lost
        if not _read_choice(kind, choice, generated):
            return False
    return True


def _read_choice(kind: ApiKind, choice: dict[str, Any], generated: Generated) -> bool:
    if kind is ApiKind.GENERATE:
        ids = choice.get(TOKEN_IDS)
        if not isinstance(ids, list):
            return False
        generated.token_ids.extend(ids)
        generated.tokens += len(ids)
        return True
    if kind is ApiKind.CHAT:
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return False
        if any(v for k, v in delta.items() if k not in _PLAIN_DELTA):  # tool_calls: [] is plain
            return False
        text = delta.get("content")
    else:
        text = choice.get("text")
    if not isinstance(text, str) and text is not None:
        return False
    if text:
        generated.parts.append(text)
        generated.tokens += 1
    return True


def continued_seed(seed: int, tokens: int) -> int:
    """The seed of a continuation after ``tokens`` generated tokens: derived from the
    original so a migrated request stays reproducible, but not the original (the engine's
    generator restarts, so the text differs from an uninterrupted run anyway)."""
    digest = hashlib.blake2b(f"{seed}:{tokens}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") & 0x7FFFFFFF


def _shrunk(options: Mapping[str, Any], tokens: int, keys: Sequence[str]) -> dict[str, Any]:
    """``options`` with the limits in ``keys`` and ``min_tokens`` reduced by ``tokens``,
    and the seed derived."""
    out = dict(options)
    for key in keys:
        limit = read_int(options.get(key), None)
        if limit is not None:
            out[key] = limit - tokens
    minimum = read_int(options.get(MIN_TOKENS), None)
    if minimum is not None:
        out[MIN_TOKENS] = max(0, minimum - tokens)
    seed = read_int(options.get("seed"), None)
    if seed is not None:
        out["seed"] = continued_seed(seed, tokens)
    return out


def remaining(kind: ApiKind, body: Mapping[str, Any], tokens: int) -> int | None:
    """Tokens the request may still generate after ``tokens`` (None: no limit set)."""
    if kind is ApiKind.GENERATE:
        params = body.get(SAMPLING_PARAMS)
        limit = read_int(params.get(MAX_TOKENS), None) if isinstance(params, Mapping) else None
    else:
        limit = read_int(body.get(MAX_COMPLETION_TOKENS), None) if kind is ApiKind.CHAT else None
        if limit is None:
            limit = read_int(body.get(MAX_TOKENS), None)
    return None if limit is None else limit - tokens


def continuation_body(
    kind: ApiKind, body: Mapping[str, Any], generated: Generated
) -> dict[str, Any]:
    """The request that continues ``body`` after ``generated`` (see the module's doc)."""
    n = generated.tokens
    if kind is ApiKind.GENERATE:
        out = dict(body)
        out[TOKEN_IDS] = [*body[TOKEN_IDS], *generated.token_ids]
        out[SAMPLING_PARAMS] = _shrunk(body[SAMPLING_PARAMS], n, (MAX_TOKENS,))
        return out
    out = _shrunk(body, n, (MAX_TOKENS, MAX_COMPLETION_TOKENS))
    if kind is ApiKind.COMPLETIONS:
        prompt = body[PROMPT]
        text = _prompt_text(prompt)
        assert text is not None  # not_migratable refused any other prompt
        whole = text + generated.whole_text()
        out[PROMPT] = [whole] if isinstance(prompt, list) else whole
        return out
    out[MESSAGES] = _continued_messages(body, generated.whole_text())
    out["continue_final_message"] = True
    out["add_generation_prompt"] = False
    return out


def _continued_messages(body: Mapping[str, Any], text: str) -> list[Any]:
    messages = list(body[MESSAGES])
    last = messages[-1] if messages else None
    continuing = read_bool(body.get("continue_final_message"))
    if continuing and isinstance(last, Mapping) and isinstance(last.get("content"), str):
        messages[-1] = {**last, "content": last["content"] + text}
    else:
        messages.append({"role": "assistant", "content": text})
    return messages


class Rewriter:
    """Makes a continuation's events read as the original stream's: its identity fields,
    no second role chunk (chat), and ``usage`` counting the ``carried`` tokens (generated
    before the cut, sent in the continuation's prompt) as completion tokens. Whole events
    out for bytes in; an event split across chunks is held until its end arrives."""

    def __init__(self, identity: Mapping[str, Any], carried: int) -> None:
        self._identity = identity
        self._carried = carried
        self._partial: list[bytes] = []  # an event's start, its end not yet come

    def __call__(self, chunk: bytes) -> bytes:
        partial = self._partial
        if (
            partial
            and _EVENT_END not in chunk
            and not (chunk[:1] == b"\n" and partial[-1][-1:] == b"\n")
        ):
            partial.append(chunk)  # no event ends here: nothing joined again (was quadratic)
            return b""
        data = b"".join([*partial, chunk]) if partial else chunk
        cut = data.rfind(_EVENT_END)
        if cut < 0:
            self._partial = [data]
            return b""
        rest = data[cut + len(_EVENT_END) :]
        self._partial = [rest] if rest else []
        events = (self._event(e) for e in data[:cut].split(_EVENT_END) if e)
        return b"".join(e + _EVENT_END for e in events if e)

    def _event(self, event: bytes) -> bytes:
        if not event.startswith(_DATA):
            return event
        try:
            data = orjson.loads(event[len(_DATA) :])
        except orjson.JSONDecodeError:
            return event  # [DONE], or what the client must see as it is
        if not isinstance(data, dict) or "choices" not in data:
            return event
        for key, value in self._identity.items():
            if key in data:
                data[key] = value
        if not _drop_role(data):
            return b""
        usage = data.get("usage")
        if isinstance(usage, dict):
            _carry(usage, self._carried)
        return _DATA + orjson.dumps(data)


def _drop_role(data: dict[str, Any]) -> bool:
    """Strip a chat role announcement; False when nothing else is left in the chunk."""
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        return True
    keep = False
    for choice in choices:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if isinstance(delta, dict) and "role" in delta:
            del delta["role"]
            if delta.get("content") or choice.get("finish_reason") is not None:
                keep = True
        else:
            keep = True
    return keep


def _carry(usage: dict[str, Any], carried: int) -> None:
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if type(prompt) is int and type(completion) is int:
        usage["prompt_tokens"] = max(0, prompt - carried)
        usage["completion_tokens"] = completion + carried


def engine_error_at(chunk: bytes) -> int:
    """Where the engine's own error event starts in ``chunk`` (a read of its stream), or -1.

    O(1) for a token's chunk: only a read that starts with one, or ends as one or with the
    ``[DONE]`` vLLM sends right after it, is searched. JSON escapes quotes and newlines in
    strings, so generated text cannot hold the marker.
    """
    if chunk.startswith(_ENGINE_ERROR):
        return 0
    if not chunk.endswith(_ERROR_ENDS):
        return -1
    at = chunk.rfind(_EVENT_END + _ENGINE_ERROR)
    return at + 2 if at >= 0 else -1
