"""A model's chat template, rendered as vLLM 0.32 renders it (through transformers 5's
``apply_chat_template``), for ``pdproxy.wire.local_tokenizer``.

The environment is transformers': a sandbox with ``trim_blocks``, ``lstrip_blocks``, loop
controls, a ``tojson`` filter that does not escape HTML, ``raise_exception`` and
``strftime_now``, and the ``{% generation %}`` tag (rendered as its body). The template sees
``messages``, ``tools`` (None), ``documents`` (None), ``add_generation_prompt`` and the
tokenizer's special tokens (``bos_token``, ``eos_token``, ...), then the request's
``chat_template_kwargs``.

Messages are shaped as vLLM's ``parse_chat_messages`` shapes them: with a template that
loops over a message's content (vLLM's "openai" content format) a text content becomes
``[{"type": "text", "text": ...}]``, else (the "string" format) text parts are joined with
newlines; a ``developer`` message is a ``system`` one unless the template names the role.
Whatever this module cannot reproduce exactly (tools, images, a message that is not plain
text, ``continue_final_message``, a request's own template) is ``Unsupported``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The message fields vLLM keeps for a plain-text message; any other (tool_calls, ...) is
# reshaped by vLLM in ways this module does not follow.
_MESSAGE_FIELDS = frozenset({"role", "content", "name"})
# What a request's chat_template_kwargs may not set here: vLLM refuses or handles them apart.
_RESERVED = frozenset(
    {"messages", "tools", "documents", "chat_template", "tokenize", "continue_final_message"}
)


class Unsupported(Exception):
    """The request's prompt cannot be rendered exactly as vLLM would; the caller scores
    it without token ids."""


class _Generation(jinja2.ext.Extension):
    """transformers' ``{% generation %}`` block, rendered as its body (the assistant-mask
    tracking it exists for is not needed here)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class ChatTemplate:
    """One compiled template; ``render`` is safe to call from several threads (jinja2
    templates are)."""

    def __init__(self, source: str, special_tokens: Mapping[str, Any]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_Generation, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        self._template = env.from_string(source)  # raises jinja2.TemplateError
        self._openai_content = _loops_over_content(env.parse(source))
        self._developer_role = '"developer"' in source or "'developer'" in source
        self._special = dict(special_tokens)

    def render(self, body: Mapping[str, Any], *, add_generation_prompt: bool) -> str:
        """The prompt vLLM renders for chat ``body``; raises ``Unsupported``."""
        if body.get("tools") or body.get("documents") or body.get("chat_template") is not None:
            raise Unsupported("tools, documents or a request's own template")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise Unsupported("no messages")
        extra = body.get("chat_template_kwargs") or {}
        if not isinstance(extra, dict) or _RESERVED & extra.keys():
            raise Unsupported("chat_template_kwargs")
        kwargs = {**self._special, "add_generation_prompt": add_generation_prompt, **extra}
        shaped = [self._message(m) for m in messages]
        try:
            return self._template.render(messages=shaped, tools=None, documents=None, **kwargs)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
            raise Unsupported(f"the chat template failed: {exc}") from exc

    def _message(self, message: object) -> dict[str, Any]:
        if not isinstance(message, dict) or not message.keys() <= _MESSAGE_FIELDS:
            raise Unsupported("a message with more than a role, a content and a name")
        role, name = message.get("role"), message.get("name")
        if not isinstance(role, str) or not (name is None or isinstance(name, str)):
            raise Unsupported("a message's role or name")
        if role == "developer" and not self._developer_role:
            role = "system"
        texts = _texts(message.get("content"))
        content: Any = (
            [{"type": "text", "text": t} for t in texts]
            if self._openai_content
            else "\n".join(texts)
        )
        shaped: dict[str, Any] = {"role": role, "content": content}
        if name is not None:
            shaped["name"] = name
        return shaped


def _texts(content: object) -> list[str]:
    """A message's content as text pieces: a string, or text parts only."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise Unsupported("a message without text content")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text":
            raise Unsupported("a content part that is not text")
        text = part.get("text")
        if not isinstance(text, str):
            raise Unsupported("a text part without text")
        texts.append(text)
    return texts


def _loops_over_content(ast: jinja2.nodes.Template) -> bool:
    """vLLM's content-format detection, for the templates it is built for: a loop over a
    message's ``content`` (``message['content']``, ``message.content``, or a variable named
    ``content``) means the template takes content parts ("openai"), else text ("string")."""
    for loop in ast.find_all(jinja2.nodes.For):
        node = loop.iter
        while isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
            node = node.node
        if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
            node = node.node
        if isinstance(node, jinja2.nodes.Name) and node.name == "content":
            return True
        if isinstance(node, jinja2.nodes.Getattr) and node.attr == "content":
            return True
        if (
            isinstance(node, jinja2.nodes.Getitem)
            and isinstance(node.arg, jinja2.nodes.Const)
            and node.arg.value == "content"
        ):
            return True
    return False
