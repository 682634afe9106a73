"""argv and ``PDPROXY_*`` environment → ``ProxyConfig`` → uvicorn. Nothing else.

Every flag can also be set from the environment: ``--kv-connector`` is
``PDPROXY_KV_CONNECTOR``; list flags take space- or comma-separated values. Flags win over
the environment. Invalid input exits with status 2 and one clear line.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from pdproxy.cli.flags import build_parser
from pdproxy.config.addresses import parse_engine_url
from pdproxy.config.listener import AdmissionConfig, ClientLimits, ListenerTLS
from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.registry import RegistryConfig, SharedRegistryConfig, parse_registry_backend
from pdproxy.config.resilience import HealthConfig, OutlierConfig, RetryConfig
from pdproxy.config.scheduling import (
    DEFAULT_DECODE_POLICY,
    DEFAULT_PREFILL_POLICY,
    SchedulingConfig,
)
from pdproxy.config.upstream import EngineTLS, PoolLimits, Timeouts
from pdproxy.errors import ConfigError
from pdproxy.membership.discovery.shared import require_etcd
from pdproxy.observability.log import configure_logging
from pdproxy.observability.tracing import require_otel, traces_url
from pdproxy.types import EngineAddress

ENV_PREFIX = "PDPROXY_"


def _apply_env(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Turn PDPROXY_* variables into parser defaults, so flags still override them."""
    defaults: dict[str, Any] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        raw = environ.get(ENV_PREFIX + action.dest.upper())
        if raw is None:
            continue
        if action.nargs == "+":
            defaults[action.dest] = raw.replace(",", " ").split()
        elif action.nargs == 0:  # a switch: store_true, or --flag/--no-flag
            defaults[action.dest] = raw.strip().lower() in ("1", "true", "yes", "on")
        else:
            try:
                defaults[action.dest] = action.type(raw) if callable(action.type) else raw
            except ValueError:
                parser.error(f"{ENV_PREFIX}{action.dest.upper()}={raw!r} is not valid")
            if action.choices is not None and defaults[action.dest] not in action.choices:
                parser.error(
                    f"{ENV_PREFIX}{action.dest.upper()} must be one of {sorted(action.choices)}"
                )
    parser.set_defaults(**defaults)


def _prefill_addresses(tokens: Sequence[str]) -> tuple[EngineAddress, ...]:
    """``URL [BOOTSTRAP_PORT] URL ...``: a bare port after a URL is its Mooncake bootstrap port."""
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


def _client_keys(args: argparse.Namespace) -> tuple[str, ...]:
    keys = list(args.api_key or ())
    if args.api_key_file:
        keys += _read_secret_file(args.api_key_file, "--api-key-file")
    return tuple(dict.fromkeys(keys))


def _engine_key(args: argparse.Namespace) -> str | None:
    if args.engine_api_key_file:
        return _read_secret_file(args.engine_api_key_file, "--engine-api-key-file")[0]
    return args.engine_api_key or None


def _admin_key(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    if args.admin_api_key_file:
        try:
            with open(args.admin_api_key_file, encoding="utf-8") as f:
                key = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read --admin-api-key-file: {exc.strerror}") from exc
        if not key:
            raise ConfigError("--admin-api-key-file is empty")
        return key
    return environ.get("ADMIN_API_KEY") or None


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> ProxyConfig:
    """Build and validate the config; raises ``ConfigError`` with a one-line reason."""
    return ProxyConfig(
        host=args.host,
        port=args.port,
        prefill=_prefill_addresses(args.prefill or ()),
        decode=tuple(EngineAddress(url=parse_engine_url(u)) for u in args.decode or ()),
        render_once=args.render_once,
        render=tuple(EngineAddress(url=parse_engine_url(u)) for u in args.render or ()),
        transfer_mode=args.transfer_mode,
        kv_connector=args.kv_connector,
        model=args.model,
        max_body_bytes=args.max_body_bytes,
        admin_api_key=_admin_key(args, environ),
        admin_allow_cidrs=tuple(args.admin_allow_cidr or ()),
        api_keys=_client_keys(args),
        protect_metrics=args.protect_metrics,
        dashboard=not args.no_dashboard,
        engine_api_key=_engine_key(args),
        admission=_admission(args),
        clients=_clients(args),
        shutdown_timeout=args.shutdown_timeout_secs,
        timeouts=_timeouts(args),
        retry=_retry(args),
        health=_health(args),
        outlier=_outlier(args),
        scheduling=_scheduling(args),
        pool=_pool(args),
        registry=_registry(args),
        tls=_listener_tls(args),
        engine_tls=_engine_tls(args),
        log_level=args.log_level,
        log_format=args.log_format,
        access_log=args.access_log,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        workers=args.workers,
    )


def _admission(a: argparse.Namespace) -> AdmissionConfig:
    return AdmissionConfig(
        max_concurrent=a.max_concurrent_requests,
        max_queued=a.max_queued_requests,
        queue_timeout=a.queue_timeout_secs,
    )


def _clients(a: argparse.Namespace) -> ClientLimits:
    return ClientLimits(
        max_head_bytes=a.max_request_head_bytes,
        max_headers=a.max_request_headers,
        header_timeout=a.client_header_timeout_secs,
        body_timeout=a.client_body_timeout_secs,
        keepalive_timeout=a.client_keepalive_timeout_secs,
        max_connections=a.max_client_connections,
    )


def _timeouts(a: argparse.Namespace) -> Timeouts:
    return Timeouts(
        connect=a.connect_timeout_secs,
        read=a.request_timeout_secs,
        prefill=a.prefill_timeout_secs,
        decode_headers=a.decode_header_timeout_secs,
    )


def _retry(a: argparse.Namespace) -> RetryConfig:
    return RetryConfig(
        max_retries=a.max_retries,
        budget_ratio=a.retry_budget_ratio,
        budget_min_per_sec=a.retry_budget_min_per_sec,
        initial_backoff=a.retry_initial_backoff_ms / 1000,
        max_backoff=a.retry_max_backoff_ms / 1000,
    )


def _health(a: argparse.Namespace) -> HealthConfig:
    return HealthConfig(
        interval=a.health_check_interval_secs,
        timeout=a.health_check_timeout_secs,
        failure_threshold=a.health_failure_threshold,
        success_threshold=a.health_success_threshold,
        endpoint=a.health_check_endpoint,
        engine_metrics_interval=a.engine_metrics_interval_secs,
        warm_pairs=a.warm_pairs,
        warm_timeout=a.warm_timeout_secs,
    )


def _scheduling(a: argparse.Namespace) -> SchedulingConfig:
    default = a.policy
    return SchedulingConfig(
        prefill_policy=a.prefill_policy or default or DEFAULT_PREFILL_POLICY,
        decode_policy=a.decode_policy or default or DEFAULT_DECODE_POLICY,
        session_header=a.session_header,
        pd_threshold_tokens=a.pd_threshold_tokens,
        decode_only_fallback=a.decode_only_fallback,
        chars_per_token=a.chars_per_token,
        prefix_block_chars=a.prefix_block_chars,
        prefix_index_max_blocks=a.prefix_index_max_blocks,
        cache_threshold=a.cache_threshold,
        balance_abs_threshold=a.balance_abs_threshold,
        balance_rel_threshold=a.balance_rel_threshold,
    )


def _outlier(a: argparse.Namespace) -> OutlierConfig:
    return OutlierConfig(
        consecutive_failures=a.outlier_consecutive_failures,
        base_ejection=a.outlier_base_ejection_secs,
        max_ejection=a.outlier_max_ejection_secs,
        max_ejection_percent=a.max_ejection_percent,
        overload_cooldown=a.overload_cooldown_secs,
    )


def _pool(a: argparse.Namespace) -> PoolLimits:
    return PoolLimits(
        max_connections=a.max_connections,
        max_connections_per_host=a.max_connections_per_host,
        keepalive_expiry=a.keepalive_expiry_secs,
        max_response_body_bytes=a.max_response_body_bytes,
    )


def _registry(a: argparse.Namespace) -> RegistryConfig:
    return RegistryConfig(
        port=a.registry_port,
        host=a.registry_host,
        ttl=a.registry_ttl,
        allow_cidrs=tuple(a.registry_allow_cidr or ()),
        max_message_bytes=a.registry_max_message_bytes,
        shared=SharedRegistryConfig(
            etcd=parse_registry_backend(a.registry_backend), prefix=a.etcd_prefix
        ),
    )


def _listener_tls(a: argparse.Namespace) -> ListenerTLS:
    return ListenerTLS(
        keyfile=a.ssl_keyfile,
        certfile=a.ssl_certfile,
        ca_certs=a.ssl_ca_certs,
        cert_reqs=a.ssl_cert_reqs,
    )


def _engine_tls(a: argparse.Namespace) -> EngineTLS:
    return EngineTLS(
        ca_certs=a.engine_ca_certs, certfile=a.engine_client_cert, keyfile=a.engine_client_key
    )


def parse_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> ProxyConfig:
    parser = build_parser()
    environ = os.environ if environ is None else environ
    _apply_env(parser, environ)
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args, environ)
        if config.otlp_traces_endpoint is not None:
            traces_url(config.otlp_traces_endpoint)
            require_otel()
        if config.registry.shared.enabled:
            require_etcd()
        return config
    except ConfigError as exc:
        parser.error(str(exc))
    raise AssertionError("unreachable")  # parser.error exits


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_config(argv)
    configure_logging(config.log_level, config.log_format)
    logging.getLogger(__name__).info(
        "pdproxy on %s:%d, connector %s, %d prefill, %d decode",
        config.host,
        config.port,
        config.kv_connector,
        len(config.prefill),
        len(config.decode),
    )
    if config.workers > 1:
        from pdproxy.runtime.supervisor import supervise

        try:
            sys.exit(supervise(config))
        except ConfigError as exc:  # what only the connector knows (pdproxy.connectors)
            build_parser().error(str(exc))

    from pdproxy.app import create_app
    from pdproxy.runtime.server import DrainingServer, uvicorn_config

    try:
        app = create_app(config)
    except ConfigError as exc:  # what only the connector knows (pdproxy.connectors)
        build_parser().error(str(exc))
    state = app.state.pdproxy
    server_config = uvicorn_config(app, config)
    DrainingServer(
        server_config,
        lambda: state.lifecycle.drain(config.shutdown_timeout),
        state.membership.listening,  # pdproxy's own address is refused as an instance
    ).run()
