"""A request's prompt token ids, computed in pdproxy from the model's own tokenizer files
(``--tokenizer``), exactly as vLLM 0.32 computes them, for the ``kv-events`` scorer.

- ``/v1/completions``: a text ``prompt`` (or a list of one) is encoded with the tokenizer's
  post-processor when ``add_special_tokens`` (vLLM's default for completions: true), so a
  model whose tokenizer adds a BOS gets it, as vLLM's does.
- ``/v1/chat/completions``: ``messages`` through the model's chat template
  (``pdproxy.wire.chat_template``, vLLM's defaults: ``add_generation_prompt`` true), then
  encoded without special tokens (vLLM's chat default; the template writes its own).

The files: a directory with ``tokenizer.json`` (and, when present, ``tokenizer_config.json``
for the special tokens, ``add_bos_token``/``add_eos_token`` and ``chat_template``, and
``chat_template.jinja``, which wins as in transformers), or a ``tokenizer.json`` itself
(its directory's other files are read the same way). As transformers 5 does, an
``add_bos_token`` or ``add_eos_token`` in the config (or a tokenizer.json with no
post-processor) rebuilds the post-processor from them.

Whatever is not reproduced exactly (a batch of prompts, ``truncate_prompt_tokens``, tools,
images, a message that is not text, a template error, a field of the wrong type) gives
None: the request is scored without token ids (the approximate index), never failed.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer, processors

from pdproxy.errors import ConfigError
from pdproxy.wire.chat_template import ChatTemplate, Unsupported
from pdproxy.wire.coerce import FieldError, lax_bool
from pdproxy.wire.shaping import MESSAGES

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
# A prompt longer than this (characters) is not tokenized: its scoring would cost the
# tokenizer's thread ~0.1 s per MiB and the request that wait; the approximate index does.
MAX_PROMPT_CHARS = 1 << 20
_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class LocalTokenizer:
    """One model's tokenizer and chat template; ``prompt_ids`` is safe to call from
    several threads (the Rust tokenizer and jinja2 templates are)."""

    def __init__(
        self, tokenizer: Tokenizer, config: Mapping[str, Any], template: str | None, name: str
    ) -> None:
        self.name = name
        self._tokenizer = tokenizer
        special = {k: v for k in _SPECIAL_TOKENS if (v := _token_text(config.get(k))) is not None}
        if "add_bos_token" in config or "add_eos_token" in config or not _has_post(tokenizer):
            _rebuild_post_processor(tokenizer, config, special)
        self._chat: ChatTemplate | None = None
        if template is not None:
            try:
                self._chat = ChatTemplate(template, special)
            except jinja2.TemplateError as exc:  # completions are still tokenized
                logger.warning("%s: its chat template does not compile (%s)", name, exc)

    @classmethod
    def load(cls, path: str) -> LocalTokenizer:
        """The tokenizer at ``path`` (a directory or its tokenizer.json); raises
        ``ConfigError``."""
        given = Path(path).expanduser()
        file = given if given.is_file() else given / TOKENIZER_FILE
        folder = file.parent
        try:
            tokenizer = Tokenizer.from_file(str(file))
            config_file = folder / CONFIG_FILE
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        except Exception as exc:  # OSError, ValueError; tokenizers raises plain Exception
            raise ConfigError(f"--tokenizer {path}: cannot load {file} ({exc})") from exc
        if not isinstance(config, dict):
            raise ConfigError(f"--tokenizer {path}: {CONFIG_FILE} is not an object")
        return cls(tokenizer, config, _template(folder, config), str(given))

    @property
    def has_chat_template(self) -> bool:
        return self._chat is not None

    def prompt_ids(self, body: Mapping[str, Any], threaded: bool = False) -> list[int] | None:
        """The prompt token ids vLLM computes for a text completion or chat ``body``, or
        None when they cannot be reproduced exactly. ``threaded``: called off the event
        loop, encode so that the GIL is released meanwhile (``encode_batch``)."""
        try:
            if MESSAGES in body:
                return self._chat_ids(body, threaded)
            return self._completion_ids(body, threaded)
        except (Unsupported, FieldError):
            return None

    def _encode(self, text: str, special: bool, threaded: bool) -> list[int]:
        if threaded:
            return list(self._tokenizer.encode_batch([text], add_special_tokens=special)[0].ids)
        return list(self._tokenizer.encode(text, add_special_tokens=special).ids)

    def _completion_ids(self, body: Mapping[str, Any], threaded: bool) -> list[int] | None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt or len(prompt) > MAX_PROMPT_CHARS:
            return None
        if body.get("truncate_prompt_tokens") is not None:
            return None
        return self._encode(prompt, _flag(body, "add_special_tokens", True), threaded)

    def _chat_ids(self, body: Mapping[str, Any], threaded: bool) -> list[int] | None:
        if self._chat is None or body.get("truncate_prompt_tokens") is not None:
            return None
        if _flag(body, "continue_final_message", False):
            return None
        if prompt_chars(body) > MAX_PROMPT_CHARS:
            return None  # checked before rendering: the cap bounds the render's cost too
        generation = _flag(body, "add_generation_prompt", True)
        text = self._chat.render(body, add_generation_prompt=generation)
        if not text or len(text) > MAX_PROMPT_CHARS:
            return None
        return self._encode(text, _flag(body, "add_special_tokens", False), threaded)


_PER_ITEM = 16  # characters a template writes around each message, part or tool at least


def prompt_chars(body: Mapping[str, Any], budget: int = MAX_PROMPT_CHARS) -> int:
    """About how many characters ``body``'s prompt renders to (what rendering and
    tokenizing it cost): a completion's prompt; for a chat, every string of its messages,
    their content parts, names and tool calls, and of its tools, plus ``_PER_ITEM`` for
    each message, part and tool (900,000 empty messages are not an empty prompt). Stops
    counting past ``budget``: a larger body is refused unrendered."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(len(p) for p in prompt if isinstance(p, str))
    messages = body.get(MESSAGES)
    if not isinstance(messages, list):
        return 0
    return _size([messages, body.get("tools")], budget)


def _size(value: object, budget: int) -> int:
    """The characters of every string in ``value`` (keys too), plus ``_PER_ITEM`` for each
    list item and object, walked without recursion; at most ``budget`` + 1."""
    total = 0
    stack = [value]
    while stack and total <= budget:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            total += _PER_ITEM
            for key, inner in item.items():
                total += len(key) if isinstance(key, str) else 0
                stack.append(inner)
        elif isinstance(item, list):
            total += _PER_ITEM * len(item)
            stack.extend(item)
        elif item is not None:
            total += 8  # a number or a boolean as the template prints it
    return min(total, budget + 1)


def _flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    return default if value is None else lax_bool(value)


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json gives it: text, or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """The chat template: chat_template.jinja, else the config's (a text, or transformers'
    list of named templates, of which the "default" one)."""
    file = folder / TEMPLATE_FILE
    if file.is_file():
        return file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _has_post(tokenizer: Tokenizer) -> bool:
    return tokenizer.post_processor is not None


def _rebuild_post_processor(
    tokenizer: Tokenizer, config: Mapping[str, Any], special: Mapping[str, str]
) -> None:
    """transformers 5's ``update_post_processor``: BOS and EOS added as the config says."""
    bos, eos = special.get("bos_token"), special.get("eos_token")
    bos_id = None if bos is None else tokenizer.token_to_id(bos)
    eos_id = None if eos is None else tokenizer.token_to_id(eos)
    add_bos = bool(config.get("add_bos_token")) and bos_id is not None
    add_eos = bool(config.get("add_eos_token")) and eos_id is not None
    single = f"{f'{bos}:0 ' if add_bos else ''}$A:0{f' {eos}:0' if add_eos else ''}"
    pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
    tokens = [(bos, bos_id)] if add_bos else []
    tokens += [(eos, eos_id)] if add_eos else []
    tokenizer.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=tokens
    )
