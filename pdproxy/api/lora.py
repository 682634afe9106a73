"""pdproxy's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: vLLM's runtime
LoRA API, fanned out to every routable instance (prefills and decodes alike, so that any
pair may serve the adapter), each instance's ``/v1/models`` re-read afterwards.

The answer is vLLM's: 200 with the engines' success line when every instance accepted;
else the first refusal as the engine gave it (a 404 for an adapter none holds, a 400 for
one already loaded...), or 502/503 when an instance could not be reached. No routable
instance: 503.
"""

from __future__ import annotations

import asyncio

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from pdproxy.api.info import authorize
from pdproxy.api.state import AppState
from pdproxy.errors import NoEndpointAvailable
from pdproxy.proxying.lora import LOAD, UNLOAD, LoraAnswer
from pdproxy.types import Endpoint

router = APIRouter()
_MAX_BODY = 64 * 1024


@router.post(LOAD)
async def load_lora_adapter(request: Request) -> Response:
    return await _fan_out(request, LOAD)


@router.post(UNLOAD)
async def unload_lora_adapter(request: Request) -> Response:
    return await _fan_out(request, UNLOAD)


async def _fan_out(request: Request, path: str) -> Response:
    state: AppState = request.app.state.pdproxy
    authorize(state, request)
    body = await request.body()
    if len(body) > _MAX_BODY:
        body = b""  # the engines answer vLLM's 400 for the missing fields
    targets = _targets(state, path, body)
    if not targets:
        raise NoEndpointAvailable("no instance is available")
    headers = {"content-type": "application/json"}
    if state.engine_authorization is not None:
        headers["authorization"] = state.engine_authorization
    answers = await asyncio.gather(
        *(_one(state, e, path, body, headers) for e in targets), return_exceptions=True
    )
    await asyncio.gather(*(state.models.read(e) for e in targets))
    for answer in answers:
        if isinstance(answer, BaseException):  # an UpstreamError: 502/503/504
            raise answer
        if not answer.ok:
            return Response(answer.body, answer.status, media_type=answer.content_type)
    first = answers[0]
    assert isinstance(first, LoraAnswer)
    return Response(first.body, first.status, media_type=first.content_type)


def _targets(state: AppState, path: str, body: bytes) -> list[Endpoint]:
    """The routable instances to ask: a load goes to those that do not list the adapter,
    an unload to those that do (an instance whose models are not known yet: both); when
    none is left, all of them, for vLLM's own answer (already loaded, cannot be found)."""
    routable = [e for e in state.registry.all() if e.routable]
    try:
        name = orjson.loads(body).get("lora_name") if body else None
    except (orjson.JSONDecodeError, AttributeError):
        name = None
    if not isinstance(name, str):
        return routable
    loading = path == LOAD
    wanted = [e for e in routable if not e.models or (name in e.models) != loading]
    return wanted or routable


async def _one(
    state: AppState, endpoint: Endpoint, path: str, body: bytes, headers: dict[str, str]
) -> LoraAnswer:
    return await state.lora.call(endpoint, path, body, headers)
