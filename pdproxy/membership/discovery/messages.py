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

A remote peer controls every byte, so ``decode`` raises nothing but
``RegistryMessageError`` for any input: each field's type is checked before the value is
hashed, looked up or parsed, and error messages never echo an arbitrary value. Addresses
follow ``pdproxy.config.addresses``: the HTTP address is written canonically (ASCII-digit port,
no unroutable host), and a ``zmq_address``, which goes into request ids and headers as the
engine wrote it, must be printable ASCII ``host:port`` or MoRIIO's form.
"""

from __future__ import annotations

import contextlib
from urllib.parse import urlsplit

import msgpack

from pdproxy.config.addresses import canonical_host, format_url, kv_address_problem, parse_host_port
from pdproxy.config.proxy import TRANSFER_MODES
from pdproxy.config.scheduling import events_endpoint
from pdproxy.errors import ConfigError, RegistryMessageError
from pdproxy.types import EngineAddress, Registration, Role

_ROLES: dict[str, Role] = {"P": Role.PREFILL, "D": Role.DECODE}

_MAX_TEXT = 512  # longest accepted string field

Message = dict[object, object]


def decode(payload: bytes, max_bytes: int) -> Registration | None:
    """Decode and validate one registration message; ``None`` for a HELLO.

    Raises only ``RegistryMessageError``, whatever ``payload`` holds.
    """
    data = _unpack(payload, max_bytes)
    kind = data.get("type")
    if not isinstance(kind, str):
        raise RegistryMessageError(f"message type must be a string, not {_kind(kind)}")
    if kind == "HELLO":
        return None
    role = _ROLES.get(kind)
    if role is not None:
        return _decode_current(data, role)
    if kind == "register":
        return _decode_legacy(data)
    raise RegistryMessageError(f"unknown message type {kind[:32]!r}")


def _unpack(payload: bytes, max_bytes: int) -> Message:
    if not payload:
        raise RegistryMessageError("empty message")
    if len(payload) > max_bytes:
        raise RegistryMessageError(f"message of {len(payload)} bytes exceeds {max_bytes}")
    try:
        data = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise RegistryMessageError("not a msgpack message") from exc
    if not isinstance(data, dict):
        raise RegistryMessageError(f"message is not a map but {_kind(data)}")
    return data


def _decode_current(data: Message, role: Role) -> Registration:
    http_address = _host_port(data.get("http_address"), "http_address")
    zmq_address = _kv_address(data.get("zmq_address"))
    moriio = any(k in data for k in ("dp_size", "tp_size", "transfer_mode"))
    address = EngineAddress(
        url=format_url("http", *http_address),
        zmq_address=zmq_address,
        dp_size=_size(data.get("dp_size", 1), "dp_size"),
        tp_size=_size(data.get("tp_size", 1), "tp_size"),
        transfer_mode=_mode(data.get("transfer_mode")) if moriio else None,
        kv_events_endpoint=_events(data, "kv_events_endpoint"),
        kv_events_replay_endpoint=_events(data, "kv_events_replay_endpoint"),
    )
    return Registration(role, address, "moriio" if moriio else "p2p")


def _events(data: Message, name: str) -> str | None:
    """An engine's own KV events endpoint (optional, pdproxy's own key)."""
    try:
        return events_endpoint(data.get(name), name)
    except ConfigError as exc:
        raise RegistryMessageError(str(exc)) from exc


def _decode_legacy(data: Message) -> Registration:
    role_name = data.get("role")
    role = _ROLES.get(role_name) if isinstance(role_name, str) else None
    if role is None:
        raise RegistryMessageError("legacy register message needs role P or D")
    scheme, host, port = _request_address(data.get("request_address"))
    handshake = _port(data.get("handshake_port"), "handshake_port")
    notify = _port(data.get("notify_port"), "notify_port")
    address = EngineAddress(
        url=format_url(scheme, host, port),
        zmq_address=f"host:{host},handshake:{handshake},notify:{notify}",
        dp_size=_size(data.get("dp_size", 1), "dp_size"),
        tp_size=_size(data.get("tp_size", 1), "tp_size"),
        transfer_mode=_mode(data.get("transfer_mode")),
    )
    return Registration(role, address, "moriio-legacy")


def _kind(value: object) -> str:
    """Names a value's type for an error message; never the value a peer chose."""
    return type(value).__name__


def _text(value: object, name: str) -> str:
    if not isinstance(value, str) or not value or len(value) > _MAX_TEXT:
        raise RegistryMessageError(f"{name} must be a non-empty string")
    return value


def _host_port(value: object, name: str) -> tuple[str, int]:
    text = _text(value, name)
    try:
        return parse_host_port(text)
    except ConfigError as exc:
        raise RegistryMessageError(f"{name} must be host:port with a routable host") from exc


def _kv_address(value: object) -> str:
    text = _text(value, "zmq_address")
    problem = kv_address_problem(text)
    if problem is not None:
        raise RegistryMessageError(f"zmq_address {problem}")
    return text


def _request_address(value: object) -> tuple[str, str, int]:
    """``http(s)://host:port/...`` split into scheme, host and a port in 1-65535."""
    url = _text(value, "request_address")
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port  # .port raises on a bad or huge port
    except ValueError as exc:
        raise RegistryMessageError("request_address must be http://host:port/...") from exc
    if parts.scheme not in ("http", "https") or not host or port is None or port < 1:
        raise RegistryMessageError("request_address must be http://host:port/...")
    try:
        return parts.scheme, canonical_host(host, url), port
    except ConfigError as exc:
        raise RegistryMessageError("request_address must name a routable host") from exc


def _size(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
        raise RegistryMessageError(f"{name} must be an integer in 1-4096")
    return value


def _port(value: object, name: str) -> int:
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = _digits(value, name)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise RegistryMessageError(f"{name} must be a port number")
    return value


def _digits(text: str, name: str) -> int:
    # int() refuses more than 4300 digits, a peer's choice (only ASCII digits get here:
    # str.isdigit() is also true for "²" and Arabic-Indic digits).
    if len(text) <= _MAX_TEXT:
        with contextlib.suppress(ValueError):
            return int(text)
    raise RegistryMessageError(f"{name} must be a port number")


def _mode(value: object) -> str:
    if not isinstance(value, str) or value.upper() not in TRANSFER_MODES:
        raise RegistryMessageError("transfer_mode must be READ or WRITE")
    return value.upper()
