"""The admin API: add, drain (its open streams migrated, if asked) and list instances.
Guarded by ``X-API-Key``.

Compatible with vLLM's disagg_proxy_demo.py (``POST /instances/add {"type", "instance"}``)
and safer: never open by default, constant-time key comparison, validated addresses (with
an optional CIDR allow-list so the API cannot be pointed at internal hosts), 409 on
duplicates and on another name of a known instance, 400 for pdproxy's own address. Every
malformed body answers 4xx with the field at fault, never 500. The key never appears in a
log line or a response, right or wrong.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import socket
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from pdproxy.api.errors import json_response
from pdproxy.api.flow import reload_tenants
from pdproxy.api.info import describe
from pdproxy.api.state import AppState
from pdproxy.config.addresses import format_url, kv_address_problem, parse_host_port
from pdproxy.config.proxy import TRANSFER_MODES
from pdproxy.config.scheduling import events_endpoint
from pdproxy.errors import AdminError, ConfigError, UpstreamError
from pdproxy.membership.instance_checks import served_models
from pdproxy.types import EngineAddress, Role

router = APIRouter(prefix="/instances")

_ROLES = {"prefill": Role.PREFILL, "decode": Role.DECODE}
_MAX_BODY = 16 * 1024
_MAX_ADDRESS = 300  # a 253-character name, a port and an IPv6 address's brackets fit


def _state(request: Request) -> AppState:
    state: AppState = request.app.state.pdproxy
    return state


def _authorize(request: Request) -> AppState:
    return authorize_admin(_state(request), request)


def authorize_admin(state: AppState, request: Request, *, bearer: bool = False) -> AppState:
    """The admin key, as ``X-API-Key`` (or, where ``bearer``, also as ``Authorization:
    Bearer KEY``, vLLM's own spelling for its LoRA API); 403 when no admin key is set."""
    key = state.config.admin_api_key
    if not key:
        raise AdminError(
            403, "the admin API is disabled: set ADMIN_API_KEY or --admin-api-key-file"
        )
    given = request.headers.get("x-api-key")
    if given is None and bearer:
        authorization = request.headers.get("authorization") or ""
        if authorization[:7].lower() == "bearer ":
            given = authorization[7:].strip()
    if given is None:
        raise AdminError(401, "missing X-API-Key header")
    if not hmac.compare_digest(given.encode("utf-8", "replace"), key.encode("utf-8")):
        raise AdminError(403, "invalid API key")
    return state


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if len(raw) > _MAX_BODY:
        raise AdminError(413, "admin request body too large")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise AdminError(400, "body must be a JSON object") from exc
    if not isinstance(body, dict):
        raise AdminError(400, "body must be a JSON object")
    return body


@router.post("/add")
async def add_instance(request: Request) -> Response:
    state = _authorize(request)
    body = await _json_body(request)
    kind = body.get("type")
    role = _ROLES.get(kind) if isinstance(kind, str) else None
    if role is None:
        raise AdminError(400, "'type' must be 'prefill' or 'decode'")
    host, port = await _allowed_address(body.get("instance"), state.config.admin_allow_cidrs)
    address = EngineAddress(
        url=format_url("http", host, port),
        zmq_address=_kv_address(body),
        dp_size=_optional_size(body, "dp_size"),
        tp_size=_optional_size(body, "tp_size"),
        transfer_mode=_optional_mode(body),
        bootstrap_url=_bootstrap_url(body, host),
        kv_events_endpoint=_events(body, "kv_events_endpoint"),
        kv_events_replay_endpoint=_events(body, "kv_events_replay_endpoint"),
    )
    await _check_stated_models(state, address.url, body.get("models"))
    link = state.owner_link  # --workers: the membership owner applies it
    endpoint = await (link or state.membership).add_admin(role, address)
    instance = describe(endpoint, state.outliers, now=state.clock())
    return json_response({"status": "added", "instance": instance})


async def _check_stated_models(state: AppState, url: str, stated: object) -> None:
    """The body's ``models`` (optional): the instance's ``/v1/models`` must list each one,
    or the call is refused (400) before the instance is admitted."""
    if stated is None:
        return
    if not isinstance(stated, list) or not all(isinstance(m, str) and m for m in stated):
        raise AdminError(400, "'models' must be a list of model names")
    try:
        answer = await state.client.get_json(url + "/v1/models")
        served = served_models(answer, state.config.health.max_models)
    except (UpstreamError, ValueError) as exc:
        raise AdminError(400, f"instance did not answer its probe: {exc}") from None
    missing = sorted(set(stated) - set(served or ()))
    if missing:
        raise AdminError(400, f"the instance does not serve {missing}")


@router.post("/remove")
@router.post("/drain")
async def remove_instance(request: Request) -> Response:
    """Drain an instance; with ``"migrate": true`` its open streams move to other decodes
    now (each that may migrate) instead of finishing there."""
    state = _authorize(request)
    body = await _json_body(request)
    host, port = _address(body.get("instance"))
    migrate = body.get("migrate", False)
    if not isinstance(migrate, bool):
        raise AdminError(400, "'migrate' must be true or false")
    url = format_url("http", host, port)
    endpoint = (
        await state.owner_link.drain(url) if state.owner_link else state.membership.drain(url)
    )
    instance = describe(endpoint, state.outliers, now=state.clock())
    answer: dict[str, Any] = {"status": "draining", "instance": instance}
    if migrate:
        answer["migrated_streams"] = state.orchestrator.migrate_streams(endpoint.url)
    return json_response(answer)


@router.get("")
async def list_instances(request: Request) -> Response:
    state = _authorize(request)
    now = state.clock()
    instances = [describe(e, state.outliers, now=now) for e in state.registry.all()]
    return json_response({"instances": instances})


def _address(value: object) -> tuple[str, int]:
    if not isinstance(value, str) or len(value) > _MAX_ADDRESS:
        raise AdminError(400, "'instance' must be a host:port string")
    try:
        return parse_host_port(value.strip())
    except ConfigError as exc:
        raise AdminError(400, f"invalid instance address: {exc}") from exc


async def _allowed_address(value: object, cidrs: tuple[str, ...]) -> tuple[str, int]:
    """Validate ``host:port``; with an allow-list, every address it resolves to must be in it."""
    host, port = _address(value)
    if not cidrs:
        return host, port
    networks = [ipaddress.ip_network(c, strict=False) for c in cidrs]
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise AdminError(400, f"cannot resolve {host!r}") from exc
    resolved = {ipaddress.ip_address(info[4][0]) for info in infos}
    if not resolved or not all(any(ip in net for net in networks) for ip in resolved):
        raise AdminError(403, f"{host!r} is outside the allowed networks")
    return host, port


def _kv_address(body: dict[str, Any]) -> str | None:
    value = body.get("zmq_address")
    if value is None:
        return None
    if not isinstance(value, str):
        raise AdminError(400, "'zmq_address' must be a string")
    problem = kv_address_problem(value)
    if problem is not None:
        raise AdminError(400, f"'zmq_address' {problem}")
    return value


def _optional_size(body: dict[str, Any], key: str) -> int:
    value = body.get(key, 1)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
        raise AdminError(400, f"'{key}' must be an integer in 1-4096")
    return value


def _optional_mode(body: dict[str, Any]) -> str | None:
    value = body.get("transfer_mode")
    if value is None:
        return None
    if not isinstance(value, str) or value.upper() not in TRANSFER_MODES:
        raise AdminError(400, "'transfer_mode' must be READ or WRITE")
    return value.upper()


def _bootstrap_url(body: dict[str, Any], host: str) -> str | None:
    value = body.get("bootstrap_port")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise AdminError(400, "'bootstrap_port' must be a port number")
    return format_url("http", host, value)


def _events(body: dict[str, Any], name: str) -> str | None:
    try:
        return events_endpoint(body.get(name), f"'{name}'")
    except ConfigError as exc:
        raise AdminError(400, str(exc)) from exc


tenants_router = APIRouter(prefix="/tenants")


@tenants_router.post("/reload")
async def reload_tenants_file(request: Request) -> Response:
    """Read the ``--tenants`` file again; queued requests keep their place. 409 without
    one, 400 (and the old file kept) for a bad one."""
    state = _authorize(request)
    if state.admission is None or state.admission.tenants.path is None:
        raise AdminError(409, "pdproxy was started without --tenants: nothing to reload")
    try:
        message = reload_tenants(state)
    except ConfigError as exc:
        raise AdminError(400, f"the tenants file was not reloaded: {exc}") from None
    return json_response({"status": "reloaded", "message": message})
