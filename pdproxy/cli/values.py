"""What the few flags that are more than a value turn into (the tables' ``convert``): instance
addresses, keys read from files, the policies ``--policy`` fills in, milliseconds as seconds."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence

from pdproxy.config.addresses import parse_engine_url
from pdproxy.config.lora import parse_lora_modules
from pdproxy.config.registry import parse_registry_backend
from pdproxy.config.scheduling import (
    DEFAULT_DECODE_POLICY,
    DEFAULT_PREFILL_POLICY,
    parse_model_policies,
    parse_tokenizers,
)
from pdproxy.config.tenants import TenantsConfig, load_tenants, valid_name
from pdproxy.errors import ConfigError
from pdproxy.types import EngineAddress


def prefill_addresses(args: argparse.Namespace) -> tuple[EngineAddress, ...]:
    """``URL [BOOTSTRAP_PORT] URL ...``: a bare port after a URL is its Mooncake bootstrap port."""
    tokens: Sequence[str] = args.prefill or ()
    addresses: list[EngineAddress] = []
    for token in tokens:
        if token.isdigit():
            if not addresses or addresses[-1].bootstrap_url is not None:
                raise ConfigError(f"--prefill: bootstrap port {token} must follow a URL")
            last = addresses[-1]
            host = last.url.split("://", 1)[1].rsplit(":", 1)[0]
            bootstrap = parse_engine_url(f"{host}:{token}")
            addresses[-1] = dataclasses.replace(last, bootstrap_url=bootstrap)
        else:
            addresses.append(EngineAddress(url=parse_engine_url(token)))
    return tuple(addresses)


def addresses(dest: str) -> Callable[[argparse.Namespace], tuple[EngineAddress, ...]]:
    """The instance URLs of list flag ``dest``, each parsed."""

    def convert(args: argparse.Namespace) -> tuple[EngineAddress, ...]:
        return tuple(EngineAddress(url=parse_engine_url(u)) for u in getattr(args, dest) or ())

    return convert


def seconds(dest: str) -> Callable[[argparse.Namespace], float]:
    """A flag given in milliseconds, as the config's seconds."""

    def convert(args: argparse.Namespace) -> float:
        return float(getattr(args, dest)) / 1000

    return convert


def prefill_policy(args: argparse.Namespace) -> str:
    return str(args.prefill_policy or args.policy or _events_default(args, DEFAULT_PREFILL_POLICY))


def decode_policy(args: argparse.Namespace) -> str:
    return str(args.decode_policy or args.policy or _events_default(args, DEFAULT_DECODE_POLICY))


def _events_default(args: argparse.Namespace, default: str) -> str:
    """``kv-events`` on both legs where the fleet's events are configured
    (``--kv-events-endpoint``): measured better than the defaults on ``make bench-sched``'s
    multi-tenant run (docs/scheduling.md); else the role's default."""
    return "kv-events" if getattr(args, "kv_events_endpoint", None) else default


def dashboard(args: argparse.Namespace) -> bool:
    return not args.no_dashboard


def registry_backend(args: argparse.Namespace) -> tuple[tuple[str, int], ...]:
    return parse_registry_backend(args.registry_backend)


def _read_secret_file(path: str, flag: str) -> list[str]:
    """Non-empty, non-comment lines of a key file; the keys never reach an error message."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
    except OSError as exc:
        raise ConfigError(f"cannot read {flag}: {exc.strerror}") from exc
    keys = [line for line in lines if line and not line.startswith("#")]
    if not keys:
        raise ConfigError(f"{flag} holds no key")
    return keys


def client_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """``--api-key`` and the keys of ``--api-key-file``, each once (a file line may name
    the key's tenant after it: ``KEY tenant=NAME``)."""
    keys = list(args.api_key or ())
    if args.api_key_file:
        keys += [key for key, _ in _key_lines(args.api_key_file)]
    return tuple(dict.fromkeys(keys))


def key_tenants(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """(key, tenant) of each ``--api-key-file`` line that names its tenant."""
    if not args.api_key_file:
        return ()
    return tuple((key, tenant) for key, tenant in _key_lines(args.api_key_file) if tenant)


def _key_lines(path: str) -> list[tuple[str, str | None]]:
    out: list[tuple[str, str | None]] = []
    for n, line in enumerate(_read_secret_file(path, "--api-key-file"), 1):
        key, named, tenant = line.rpartition(" tenant=")
        if not named:
            out.append((line, None))
            continue
        if not valid_name(tenant) or not key.strip():
            raise ConfigError(
                f"--api-key-file line {n}: 'KEY tenant=NAME' needs a key and a tenant name of"
                " 1-128 printable characters without spaces"
            )
        out.append((key.strip(), tenant))
    return out


def tenants(args: argparse.Namespace) -> TenantsConfig:
    """``--tenants FILE`` and ``--tenant-header NAME``."""
    header = args.tenant_header.lower() if args.tenant_header else None
    if args.tenants:
        return load_tenants(args.tenants, header)
    return TenantsConfig(header=header)


def engine_key(args: argparse.Namespace) -> str | None:
    """``--engine-api-key-file`` wins over ``--engine-api-key``."""
    if args.engine_api_key_file:
        return _read_secret_file(args.engine_api_key_file, "--engine-api-key-file")[0]
    return args.engine_api_key or None


def admin_key(args: argparse.Namespace) -> str | None:
    """``--admin-api-key-file``, else ``PDPROXY_ADMIN_API_KEY``, else ``ADMIN_API_KEY``."""
    if args.admin_api_key_file:
        try:
            with open(args.admin_api_key_file, encoding="utf-8") as f:
                key = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read --admin-api-key-file: {exc.strerror}") from exc
        if not key:
            raise ConfigError("--admin-api-key-file is empty")
        return key
    return args.admin_api_key or None


def lora_modules(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """``--lora-modules NAME=PATH ...`` as (name, path) pairs."""
    return parse_lora_modules(args.lora_modules or ())


def model_policies(args: argparse.Namespace) -> tuple[tuple[str, str, str], ...]:
    """``--model-policy MODEL=PREFILL[:DECODE] ...``."""
    return parse_model_policies(tuple(args.model_policy or ()))


def tokenizers(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """``--tokenizer [MODEL=]PATH ...``."""
    return parse_tokenizers(tuple(args.tokenizer or ()))
