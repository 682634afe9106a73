"""What scheduling needs from a request body: its model, a prompt-size estimate, a
session key and, when a prefix index is in use, the prompt's chained block hashes.

The prompt is rendered to a stable text first: a completion's ``prompt`` as given (a
list of prompts joined, token ids counted one token each, as a token-in request's
``token_ids`` are); a chat's ``messages`` as
role and text content in order, so two requests sharing a system prompt and history
share a prefix. Tools, images and sampling options are not part of it: they change what
the engine computes after the prefix, rarely the prefix itself. Only what the block hashes
read is built (``_MAX_BLOCKS`` blocks): a prompt of 15 M token ids costs a count and the
text of its first ids, never the text of all of them.

The size estimate is characters divided by ``chars_per_token`` (4 by default, about
right for English with a BPE tokenizer), or the exact count for token ids.

Two kinds of request are served by a decode alone, whatever the prompt size, because vLLM
0.32 cannot split them across a prefill and a decode correctly (``one_leg_reason``). Their
fields are read as vLLM reads them (``pdproxy.wire.coerce``: ``n: "2"`` and ``n: 2.0`` are 2,
``"true"`` is true), and a token-in body's from its ``sampling_params`` alone:

* ``parallel_sampling`` (``n``, ``best_of`` > 1, ``use_beam_search``): vLLM forks one
  request per choice (``{i}_{request_id}``, ``ParentRequest.get_child_info``), each with a
  copy of the same ``kv_transfer_params``. On the prefill each child holds its own blocks but
  only one child's params come back (the others' blocks wait for the lease); on the decode
  every child reads the *same* remote request, and the prefill frees it on the first reader's
  notification (one consumer expected), so the later children read blocks that may already be
  freed ("Potentially invalid KV blocks for unrecognized request 1_cmpl-…" on the prefill).
* ``prompt_logprobs`` (or a completion's ``echo`` with ``logprobs``, or a chat's ``echo``,
  which vLLM turns into prompt logprobs: a chat's ``top_logprobs`` is never null, 0 by
  default): such a request skips reading any prefix cache, the connector's included
  (``SamplingParams.skip_reading_prefix_cache``), so the decode recomputes the whole prompt
  anyway and the prefill's work would be thrown away.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from pdproxy.scheduling.context import RequestFeatures
from pdproxy.wire.coerce import read_bool, read_int
from pdproxy.wire.shaping import MESSAGES, SAMPLING_PARAMS, is_token_in

_ROLE_SEP = "\x1f"
_MESSAGE_SEP = "\x1e"
_MAX_BLOCKS = 1024  # hash at most this many blocks of a very long prompt
_ID_CHUNK = 1024  # token ids stringified at a time, until the hashed text is long enough


@dataclass(frozen=True, slots=True)
class FeatureConfig:
    chars_per_token: float = 4.0
    block_chars: int = 256
    session_from_user: bool = True  # the body's "user" when no session header


def extract(
    body: Mapping[str, Any],
    session_header: str | None,
    config: FeatureConfig,
    *,
    want_blocks: bool,
    want_token_ids: bool = False,
) -> RequestFeatures:
    model = body.get("model")
    prompt = render_prompt(body, config.block_chars * _MAX_BLOCKS if want_blocks else 0)
    tokens = (
        prompt.token_ids if prompt.token_ids is not None else prompt.chars / config.chars_per_token
    )
    session = session_header
    if session is None and config.session_from_user:
        user = body.get("user")
        session = user if isinstance(user, str) and user else None
    blocks = block_hashes(prompt.text, config.block_chars) if want_blocks else ()
    token_ids = prompt_token_ids(body) if want_token_ids else None
    salt = body.get("cache_salt") if want_token_ids else None
    return RequestFeatures(
        model=model if isinstance(model, str) else None,
        tokens=float(tokens),
        session=session,
        blocks=blocks,
        one_leg=one_leg_reason(body),
        token_ids=token_ids,
        cache_salt=salt if isinstance(salt, str) else None,
    )


def prompt_token_ids(body: Mapping[str, Any]) -> list[int] | None:
    """The prompt's token ids when the body gives one prompt as ids (a token-in
    completion, or ``/inference/v1/generate``'s ``token_ids``, which ``--render-once``
    sends), else None. Only the first id is type-checked: vLLM refuses a list that mixes
    them, and a wrong guess costs a cache miss, never a wrong answer."""
    ids = body.get("token_ids", body.get("prompt"))
    if isinstance(ids, list) and ids and isinstance(ids[0], int) and not isinstance(ids[0], bool):
        return ids
    return None


PARALLEL_SAMPLING = "parallel_sampling"
PROMPT_LOGPROBS = "prompt_logprobs"


def one_leg_reason(body: Mapping[str, Any]) -> str | None:
    """Why ``body`` must be served by a decode alone (see the module docstring), or None.

    Reads the OpenAI body's fields or, for a token-in ``/inference/v1/generate`` body, its
    ``sampling_params`` alone (a top-level ``n`` there is no field of vLLM's), each as vLLM
    coerces it.
    """
    fields: Mapping[str, Any] = body[SAMPLING_PARAMS] if is_token_in(body) else body
    if read_int(fields.get("n"), 1) > 1 or read_int(fields.get("best_of"), 1) > 1:
        return PARALLEL_SAMPLING
    if read_bool(fields.get("use_beam_search")):
        return PARALLEL_SAMPLING
    if read_int(fields.get("prompt_logprobs"), None) is not None:
        return PROMPT_LOGPROBS
    # A chat's echo always asks for prompt logprobs (its top_logprobs, 0 when unset); a
    # completion's only with logprobs (0, or false read as 0, counts).
    echo = fields is body and read_bool(body.get("echo"))
    if echo and (MESSAGES in body or read_int(body.get("logprobs"), None) is not None):
        return PROMPT_LOGPROBS
    return None


class Rendered(NamedTuple):
    """A prompt's stable text (at most the ``limit`` characters asked for), the length of
    the whole text, and its exact token count when it was given as token ids."""

    text: str
    chars: int
    token_ids: int | None


_EMPTY = Rendered("", 0, None)


def render_prompt(body: Mapping[str, Any], limit: int) -> Rendered:
    """The prompt as stable text, built only up to ``limit`` characters (0: only measured).

    The text is always a prefix of the whole rendering, so block hashes of the first
    ``limit`` characters are those of the whole prompt's.
    """
    messages = body.get(MESSAGES)
    if isinstance(messages, list):
        return _render_messages(messages, _Text(limit))
    prompt = body.get("prompt", body.get("token_ids"))  # token_ids: /inference/v1/generate
    if isinstance(prompt, str):
        return Rendered(prompt[:limit], len(prompt), None)
    if not isinstance(prompt, list) or not prompt:
        return _EMPTY
    # A prompt's form is told by its first item: vLLM refuses a list that mixes them, so
    # a mixed one needs no exact features, and nothing here walks a huge prompt's items.
    first = prompt[0]
    if isinstance(first, str):
        return _render_strings(prompt, _Text(limit))
    if isinstance(first, int):
        return Rendered(_ids_text(prompt, limit) if limit > 0 else "", 0, len(prompt))
    if isinstance(first, list):  # a batch of token-id prompts
        return _render_batch(prompt, _Text(limit))
    return _EMPTY


class _Text:
    """At most ``room`` characters of a rendering built piece by piece, and the length the
    whole rendering would have."""

    __slots__ = ("chars", "parts", "room")

    def __init__(self, room: int) -> None:
        self.parts: list[str] = []
        self.room = room
        self.chars = 0

    def add(self, piece: str) -> None:
        self.chars += len(piece)
        if self.room > 0:
            piece = piece[: self.room]
            self.parts.append(piece)
            self.room -= len(piece)

    def text(self) -> str:
        return "".join(self.parts)


def _render_strings(prompts: list[Any], out: _Text) -> Rendered:
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            break
        if i:
            out.add(_MESSAGE_SEP)
        out.add(prompt)
    return Rendered(out.text(), out.chars, None)


def _render_batch(prompts: list[Any], out: _Text) -> Rendered:
    count = sum(len(p) for p in prompts if isinstance(p, list))
    for i, prompt in enumerate(prompts):
        if out.room <= 0 or not isinstance(prompt, list):
            break
        if i:
            out.add(_MESSAGE_SEP)
        out.add(_ids_text(prompt, out.room))
    return Rendered(out.text(), 0, count)


def _ids_text(ids: list[Any], room: int) -> str:
    """``",".join(map(str, ids))[:room]``, stringifying only the ids that text needs (and
    none past the first item that is not an int)."""
    chunks: list[str] = []
    size = -1  # the length of ",".join(chunks)
    for start in range(0, len(ids), _ID_CHUNK):
        if size >= room:
            break
        chunk = ids[start : start + _ID_CHUNK]
        end = next((i for i, t in enumerate(chunk) if not isinstance(t, int)), len(chunk))
        if end:
            text = ",".join(map(str, chunk[:end]))
            chunks.append(text)
            size += len(text) + 1
        if end < len(chunk):
            break
    return ",".join(chunks)[:room]


def _render_messages(messages: list[Any], out: _Text) -> Rendered:
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        out.add(role if isinstance(role, str) else "")
        out.add(_ROLE_SEP)
        content = message.get("content")
        if isinstance(content, str):
            out.add(content)
        elif isinstance(content, list):  # content parts: keep the text ones
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    out.add(part["text"])
        out.add(_MESSAGE_SEP)
    return Rendered(out.text(), out.chars, None)


def block_hashes(text: str, block_chars: int) -> tuple[int, ...]:
    """Chained hashes of ``text``'s whole blocks (and a last partial one): block ``i``'s
    hash depends on every character up to its end. Process-local (Python's ``hash``)."""
    hashes: list[int] = []
    previous = 0
    end = min(len(text), block_chars * _MAX_BLOCKS)
    for start in range(0, end, block_chars):
        previous = hash((previous, text[start : start + block_chars]))
        hashes.append(previous)
    return tuple(hashes)
