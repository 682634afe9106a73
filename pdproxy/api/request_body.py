"""A generation request's body as the endpoints read it: whole, once, with a cap, then
parsed once with orjson and checked as vLLM's models would (``parse_body``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from starlette.types import Message, Receive

from pdproxy.api.errors import JSON
from pdproxy.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType
from pdproxy.types import ApiKind
from pdproxy.wire.body_fields import check_body
from pdproxy.wire.shaping import MESSAGES, MODEL, PROMPT, SAMPLING_PARAMS, TOKEN_IDS, is_token_in


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


_REQUIRED = {ApiKind.COMPLETIONS: PROMPT, ApiKind.CHAT: MESSAGES, ApiKind.GENERATE: TOKEN_IDS}


async def read_json_body(headers: dict[str, str], receive: Receive, limit: int) -> bytes:
    """A JSON request's body, read once with a cap: 415 for another content type, 413 past
    ``limit`` (declared or read)."""
    content_type = headers.get("content-type", "")
    if content_type.split(";", 1)[0].strip().lower() != JSON:
        raise UnsupportedMediaType("Content-Type must be application/json")
    declared = headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body exceeds {limit} bytes")
    return await _read_body(receive, limit)


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def json_object(raw: bytes) -> dict[str, Any]:
    """A body that must be one JSON object, else a 400 saying what it is instead."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"invalid JSON body: {exc.msg}") from exc
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def parse_body(raw: bytes, kind: ApiKind) -> Mapping[str, Any]:
    body = json_object(raw)
    if not isinstance(body.get(MODEL), str) or not body[MODEL]:
        raise BadRequest("'model' is required", param=MODEL)
    required = _REQUIRED[kind]
    if required not in body or body[required] in (None, "", []):
        raise BadRequest(f"'{required}' is required", param=required)
    # The legs are shaped by the body's shape (shaping.body_kind): a body is token-in
    # shaped exactly when it came on /inference/v1/generate.
    if kind is ApiKind.GENERATE and not isinstance(body.get(SAMPLING_PARAMS), dict):
        raise BadRequest(f"'{SAMPLING_PARAMS}' must be an object", param=SAMPLING_PARAMS)
    if kind is not ApiKind.GENERATE and is_token_in(body):
        raise BadRequest(
            f"'{SAMPLING_PARAMS}' with '{TOKEN_IDS}' is for {ApiKind.GENERATE.path}",
            param=SAMPLING_PARAMS,
        )
    # The fields pdproxy decides on, as vLLM's models read them: a value vLLM would refuse
    # is refused here, before any leg (the body goes to the engines as the client sent it).
    check_body(kind, body)
    return body
