"""Tenants: who shares the fleet, in what proportion, at what priority, within what limits
(``--tenants FILE``, JSON or YAML).

The file maps each tenant's name to its entry; the entry named ``default`` applies to every
request whose tenant is not listed (and to all requests when the file lists no other)::

    default: {weight: 1}
    interactive: {weight: 3, priority: 0}
    batch: {weight: 1, priority: 10, max_concurrent: 64, tokens_per_minute: 2000000}

Each entry: ``weight`` (its share under contention, > 0, default 1), ``priority`` (the
default of its requests that give none; lower is served sooner, vLLM's sense, default 0),
``max_concurrent`` (its requests served at once, 0: no limit), ``tokens_per_minute`` and
``requests_per_minute`` (0: no limit). Anything else in the file is refused at start-up
with the key (and, for a syntax error, the line) named.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdproxy.errors import ConfigError

DEFAULT_TENANT = "default"
MAX_TENANTS = 10_000  # listed tenants; each has a share, limits and metric series
MAX_NAME = 128  # characters of a tenant's name, in the file or in a request's header
_LIMIT = 10**12  # a limit above this is a typo, not a plan
_FIELDS = ("weight", "priority", "max_concurrent", "tokens_per_minute", "requests_per_minute")


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantSpec:
    weight: float = 1.0
    priority: int = 0
    max_concurrent: int = 0
    tokens_per_minute: int = 0
    requests_per_minute: int = 0

    @property
    def limited(self) -> bool:
        return bool(self.max_concurrent or self.tokens_per_minute or self.requests_per_minute)


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantsConfig:
    """The tenants file, the header that names a request's tenant when client keys do not
    (``--tenant-header``), and where the file was read from (for a reload)."""

    # a plain dict (a config is pickled to --workers' processes), never written after load
    tenants: Mapping[str, TenantSpec] = field(default_factory=dict)
    default: TenantSpec = TenantSpec()
    header: str | None = None
    path: str | None = None

    @property
    def enabled(self) -> bool:
        """Flow control beyond the global limit: a tenants file or a tenant header."""
        return (
            self.path is not None
            or self.header is not None
            or bool(self.tenants)
            or self.default != TenantSpec()
        )

    def spec(self, tenant: str) -> TenantSpec:
        return self.tenants.get(tenant, self.default)

    def known(self, tenant: str) -> str:
        """``tenant`` when the file lists it, else the default tenant's name."""
        return tenant if tenant in self.tenants else DEFAULT_TENANT


def load_tenants(path: str, header: str | None = None) -> TenantsConfig:
    """Read and check ``path``; raises ``ConfigError`` naming the line or key at fault."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read --tenants {path}: {exc}") from exc
    data = _parse(text, path)
    if not isinstance(data, dict):
        raise ConfigError(f"--tenants {path}: the file must map tenant names to entries")
    if len(data) > MAX_TENANTS:
        raise ConfigError(f"--tenants {path}: more than {MAX_TENANTS} tenants")
    specs: dict[str, TenantSpec] = {}
    for name, entry in data.items():
        if not isinstance(name, str) or not valid_name(name):
            raise ConfigError(
                f"--tenants {path}: tenant name {str(name)[:MAX_NAME]!r} must be 1-{MAX_NAME}"
                " printable ASCII characters without spaces"
            )
        specs[name] = _spec(entry, f"--tenants {path}: tenant {name!r}")
    default = specs.pop(DEFAULT_TENANT, TenantSpec())
    return TenantsConfig(tenants=specs, default=default, header=header, path=path)


def valid_name(name: str) -> bool:
    return 0 < len(name) <= MAX_NAME and name.isascii() and name.isprintable() and " " not in name


def _parse(text: str, path: str) -> Any:
    if path.endswith((".yaml", ".yml")):
        import yaml  # only with a YAML file

        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or "invalid YAML"
            raise ConfigError(f"--tenants {path}: {problem}{where}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--tenants {path}: {exc.msg} at line {exc.lineno}") from None


def _spec(entry: object, where: str) -> TenantSpec:
    if entry is None:
        return TenantSpec()
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: its entry must be a mapping of {', '.join(_FIELDS)}")
    unknown = [str(k) for k in entry if k not in _FIELDS]
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0][:64]!r} (known: {', '.join(_FIELDS)})")
    weight = entry.get("weight", 1.0)
    if not _number(weight) or not 0 < weight <= 1e6:
        raise ConfigError(f"{where}: weight must be a number in (0, 1e6]")
    values = {}
    for key in _FIELDS[1:]:
        value = entry.get(key, 0)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{where}: {key} must be an integer")
        lowest = -(2**31) if key == "priority" else 0
        if not lowest <= value <= _LIMIT:
            raise ConfigError(f"{where}: {key} must be in [{lowest}, {_LIMIT}]")
        values[key] = value
    return TenantSpec(weight=float(weight), **values)


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
