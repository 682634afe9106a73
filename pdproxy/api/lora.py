"""pdproxy's ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: vLLM's runtime
LoRA API, fanned out to every routable instance (prefills and decodes alike, so that any
pair may serve the adapter), each instance's ``/v1/models`` re-read afterwards.

The answer is vLLM's: 200 with the engines' success line when some instance loaded
(unloaded) the adapter and every other one already held it (did not hold it); vLLM's 400
(404) when every instance already held it (none held it); another refusal as the engine
gave it; 502/503 when an instance could not be reached. No routable instance: 503.
"""

from __future__ import annotations

import asyncio
import posixpath

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from pdproxy.api.admin import authorize_admin
from pdproxy.api.state import AppState
from pdproxy.errors import AdminError, NoEndpointAvailable
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
    authorize_admin(state, request, bearer=True)  # loading weights fleet-wide is admin work
    body = await request.body()
    if len(body) > _MAX_BODY:
        body = b""  # the engines answer vLLM's 400 for the missing fields
    if path == LOAD:
        _check_lora_path(state, body)
    targets = [e for e in state.registry.all() if e.routable]
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
    chosen = _verdict([a for a in answers if isinstance(a, LoraAnswer)], path)
    return Response(chosen.body, chosen.status, media_type=chosen.content_type)


def _verdict(answers: list[LoraAnswer], path: str) -> LoraAnswer:
    """The answer for the client: a success when some instance changed and every other
    one only said it had nothing to change (an unload's 404 where the adapter was not, a
    load's 400 where it already was); else the first other refusal; else the first."""
    done = [a for a in answers if a.ok]
    other = [a for a in answers if not a.ok and not _nothing_to_do(a, path)]
    if other:
        return other[0]
    return done[0] if done else answers[0]


def _nothing_to_do(answer: LoraAnswer, path: str) -> bool:
    if path == UNLOAD:
        return answer.status == 404
    return answer.status == 400 and b"already been loaded" in answer.body


async def _one(
    state: AppState, endpoint: Endpoint, path: str, body: bytes, headers: dict[str, str]
) -> LoraAnswer:
    return await state.lora.call(endpoint, path, body, headers)


def _check_lora_path(state: AppState, body: bytes) -> None:
    """With ``--lora-path-root``, a load's ``lora_path`` must be one of ``--lora-modules``'
    paths or lie under a root (compared as normalised paths, component by component: no
    ``..`` out of a root); 403 otherwise, before any engine is asked."""
    lora = state.config.lora
    if not lora.path_roots:
        return
    try:
        data = orjson.loads(body) if body else {}
    except orjson.JSONDecodeError:
        return  # the engines answer vLLM's own 400
    path = data.get("lora_path") if isinstance(data, dict) else None
    if path is None:
        return
    if not isinstance(path, str) or not lora_path_allowed(path, lora.path_roots, lora.paths):
        raise AdminError(
            403, "lora_path is not one of --lora-modules' paths nor under a --lora-path-root"
        )


def lora_path_allowed(path: str, roots: tuple[str, ...], named: dict[str, str]) -> bool:
    if "\x00" in path or not path.startswith("/"):
        return False
    clean = posixpath.normpath(path)
    if clean in {posixpath.normpath(p) for p in named.values()}:
        return True
    for root in roots:
        base = posixpath.normpath(root)
        if clean == base or clean.startswith(base.rstrip("/") + "/"):
            return True
    return False
