"""What scheduling needs from a request body: its model, a prompt-size estimate, a
session key and, when a prefix index is in use, the prompt's chained block hashes.

The prompt is rendered to a stable text first: a completion's ``prompt`` as given (a
list of prompts joined, token ids counted one token each, as a token-in request's
``token_ids`` are); a chat's ``messages`` as
role and text content in order, so two requests sharing a system prompt and history
share a prefix. Tools, images and sampling options are not part of it: they change what
the engine computes after the prefix, rarely the prefix itself.

The size estimate is characters divided by ``chars_per_token`` (4 by default, about
right for English with a BPE tokenizer), or the exact count for token ids.

Two kinds of request are served by a decode alone, whatever the prompt size, because vLLM
0.32 cannot split them across a prefill and a decode correctly (``one_leg_reason``):

* ``parallel_sampling`` (``n``, ``best_of`` > 1, ``use_beam_search``): vLLM forks one
  request per choice (``{i}_{request_id}``, ``ParentRequest.get_child_info``), each with a
  copy of the same ``kv_transfer_params``. On the prefill each child holds its own blocks but
  only one child's params come back (the others' blocks wait for the lease); on the decode
  every child reads the *same* remote request, and the prefill frees it on the first reader's
  notification (one consumer expected), so the later children read blocks that may already be
  freed ("Potentially invalid KV blocks for unrecognized request 1_cmpl-…" on the prefill).
* ``prompt_logprobs`` (or ``echo`` with ``logprobs``/``top_logprobs``, which vLLM turns into
  prompt logprobs): such a request skips reading any prefix cache, the connector's included
  (``SamplingParams.skip_reading_prefix_cache``), so the decode recomputes the whole prompt
  anyway and the prefill's work would be thrown away.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdproxy.scheduling.context import RequestFeatures

_ROLE_SEP = "\x1f"
_MESSAGE_SEP = "\x1e"
_MAX_BLOCKS = 1024  # hash at most this many blocks of a very long prompt


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
) -> RequestFeatures:
    model = body.get("model")
    text, token_ids = render_prompt(body)
    tokens = token_ids if token_ids is not None else len(text) / config.chars_per_token
    session = session_header
    if session is None and config.session_from_user:
        user = body.get("user")
        session = user if isinstance(user, str) and user else None
    blocks = block_hashes(text, config.block_chars) if want_blocks else ()
    return RequestFeatures(
        model=model if isinstance(model, str) else None,
        tokens=float(tokens),
        session=session,
        blocks=blocks,
        one_leg=one_leg_reason(body),
    )


PARALLEL_SAMPLING = "parallel_sampling"
PROMPT_LOGPROBS = "prompt_logprobs"


def one_leg_reason(body: Mapping[str, Any]) -> str | None:
    """Why ``body`` must be served by a decode alone (see the module docstring), or None.

    Reads the OpenAI body's fields and, for the token-in ``/inference/v1/generate`` body,
    its ``sampling_params``.
    """
    nested = body.get("sampling_params")
    fields = {**nested, **body} if isinstance(nested, Mapping) else body
    if _more_than_one(fields.get("n")) or _more_than_one(fields.get("best_of")):
        return PARALLEL_SAMPLING
    if fields.get("use_beam_search") is True:
        return PARALLEL_SAMPLING
    if fields.get("prompt_logprobs") is not None:
        return PROMPT_LOGPROBS
    logprobs = fields.get("top_logprobs") if "messages" in body else fields.get("logprobs")
    if fields.get("echo") is True and logprobs not in (None, False):
        return PROMPT_LOGPROBS
    return None


def _more_than_one(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 1


def render_prompt(body: Mapping[str, Any]) -> tuple[str, int | None]:
    """The prompt as stable text, and its exact token count when it was given as ids."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return _render_messages(messages), None
    prompt = body.get("prompt", body.get("token_ids"))  # token_ids: /inference/v1/generate
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return _MESSAGE_SEP.join(prompt), None
        if all(isinstance(t, int) for t in prompt):
            return ",".join(map(str, prompt)), len(prompt)
        if all(isinstance(p, list) for p in prompt):  # a batch of token-id prompts
            return _MESSAGE_SEP.join(",".join(map(str, p)) for p in prompt), sum(map(len, prompt))
    return "", None


def _render_messages(messages: list[Any]) -> str:
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        parts.append(role if isinstance(role, str) else "")
        parts.append(_ROLE_SEP)
        parts.append(_content_text(message.get("content")))
        parts.append(_MESSAGE_SEP)
    return "".join(parts)


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return "".join(
            p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return ""


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
