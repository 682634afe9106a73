"""The registration wire schema: the msgpack dicts vLLM engines send to a proxy's ROUTER.

Three formats, all decoded into one ``Registration``:

* P2P-NCCL: ``{"type": "P"|"D", "http_address": "ip:port", "zmq_address": "ip:port"}``
* MoRIIO (vLLM >= 2026): the same keys plus ``dp_size``, ``tp_size`` and ``transfer_mode``
  (``"READ"``|``"WRITE"``), with ``zmq_address = "host:IP,handshake:PORT,notify:PORT"``
* MoRIIO legacy: ``{"type": "register", "role": "P"|"D", "request_address":
  "http://ip:port/v1/completions", "handshake_port", "notify_port", "dp_size", "tp_size",
  "transfer_mode"}``

``{"type": "HELLO"}`` is a greeting and decodes to ``None``. Anything else raises
``RegistryMessageError``. A message is a full statement of the instance, never a delta, so
applying it twice is harmless (engines re-send every 3 s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgpack

from pdproxy.config import TRANSFER_MODES, format_url, parse_host_port
from pdproxy.errors import ConfigError, RegistryMessageError
from pdproxy.types import EngineAddress, Role

_ROLES = {"P": Role.PREFILL, "D": Role.DECODE}


@dataclass(frozen=True, slots=True)
class Registration:
    role: Role
    address: EngineAddress
    format: str  # "p2p" | "moriio" | "moriio-legacy"


def decode(payload: bytes, max_bytes: int) -> Registration | None:
    """Decode and validate one registration message; ``None`` for a HELLO."""
    if len(payload) > max_bytes:
        raise RegistryMessageError(f"message of {len(payload)} bytes exceeds {max_bytes}")
    try:
        data = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise RegistryMessageError("not a msgpack message") from exc
    if not isinstance(data, dict):
        raise RegistryMessageError("message is not a map")
    kind = data.get("type")
    if kind == "HELLO":
        return None
    if kind in _ROLES:
        return _decode_current(data, _ROLES[kind])
    if kind == "register":
        return _decode_legacy(data)
    raise RegistryMessageError(f"unknown message type {kind!r}")


def _decode_current(data: dict[str, Any], role: Role) -> Registration:
    http_address = _host_port(data.get("http_address"), "http_address")
    zmq_address = _text(data.get("zmq_address"), "zmq_address")
    moriio = any(k in data for k in ("dp_size", "tp_size", "transfer_mode"))
    address = EngineAddress(
        url=format_url("http", *http_address),
        zmq_address=zmq_address,
        dp_size=_size(data.get("dp_size", 1), "dp_size"),
        tp_size=_size(data.get("tp_size", 1), "tp_size"),
        transfer_mode=_mode(data.get("transfer_mode")) if moriio else None,
    )
    return Registration(role, address, "moriio" if moriio else "p2p")


def _decode_legacy(data: dict[str, Any]) -> Registration:
    role = _ROLES.get(data.get("role"))  # type: ignore[arg-type]
    if role is None:
        raise RegistryMessageError("legacy register message needs role P or D")
    url = _text(data.get("request_address"), "request_address")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise RegistryMessageError("request_address must be http://host:port/...")
    host, port = parts.hostname, parts.port
    handshake = _port(data.get("handshake_port"), "handshake_port")
    notify = _port(data.get("notify_port"), "notify_port")
    address = EngineAddress(
        url=format_url(parts.scheme, host, port),
        zmq_address=f"host:{host},handshake:{handshake},notify:{notify}",
        dp_size=_size(data.get("dp_size", 1), "dp_size"),
        tp_size=_size(data.get("tp_size", 1), "tp_size"),
        transfer_mode=_mode(data.get("transfer_mode")),
    )
    return Registration(role, address, "moriio-legacy")


def _text(value: object, name: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 512:
        raise RegistryMessageError(f"{name} must be a non-empty string")
    return value


def _host_port(value: object, name: str) -> tuple[str, int]:
    try:
        return parse_host_port(_text(value, name))
    except ConfigError as exc:
        raise RegistryMessageError(f"{name}: {exc}") from exc


def _size(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
        raise RegistryMessageError(f"{name} must be an integer in 1-4096")
    return value


def _port(value: object, name: str) -> int:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise RegistryMessageError(f"{name} must be a port number")
    return value


def _mode(value: object) -> str:
    if not isinstance(value, str) or value.upper() not in TRANSFER_MODES:
        raise RegistryMessageError("transfer_mode must be READ or WRITE")
    return value.upper()
