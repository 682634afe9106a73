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

from pdproxy.config import (
    KV_CONNECTORS,
    TRANSFER_MODES,
    AdmissionConfig,
    EngineTLS,
    HealthConfig,
    ListenerTLS,
    OutlierConfig,
    PoolLimits,
    ProxyConfig,
    RegistryConfig,
    RetryConfig,
    Timeouts,
    parse_engine_url,
)
from pdproxy.errors import ConfigError
from pdproxy.log import configure_logging
from pdproxy.types import EngineAddress

ENV_PREFIX = "PDPROXY_"
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdproxy",
        description="Prefill/decode disaggregation proxy for vLLM. Every flag can also be set "
        "as a PDPROXY_* environment variable (e.g. PDPROXY_KV_CONNECTOR=nixl).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for add_group in (
        _instance_flags,
        _server_flags,
        _upstream_flags,
        _retry_flags,
        _health_flags,
        _registry_flags,
        _admin_flags,
        _security_flags,
        _lifecycle_flags,
    ):
        add_group(p)
    return p


def _instance_flags(p: argparse.ArgumentParser) -> None:
    urls = "host:port or http(s)://host:port"
    p.add_argument(
        "--prefill",
        nargs="+",
        action="extend",
        metavar="URL",
        help=f"Prefill instance(s), as {urls}; a port after one is its Mooncake bootstrap port.",
    )
    p.add_argument(
        "--decode",
        nargs="+",
        action="extend",
        metavar="URL",
        help=f"Decode instance(s), as {urls}.",
    )
    p.add_argument(
        "--kv-connector",
        default="nixl",
        choices=sorted(KV_CONNECTORS),
        help="The engines' KV connector, which fixes how the two legs are shaped.",
    )
    p.add_argument("--model", default=None, help="Only route to instances that serve this model.")
    p.add_argument(
        "--transfer-mode",
        type=str.upper,
        choices=TRANSFER_MODES,
        default=None,
        help="KV transfer mode all instances share (MoRIIO); by default the first one fixes it.",
    )


def _server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="0.0.0.0", help="Address the proxy listens on.")
    p.add_argument("--port", type=int, default=8000, help="Port the proxy listens on.")
    p.add_argument(
        "--max-body-bytes",
        "--max-payload-size",
        dest="max_body_bytes",
        type=int,
        default=32 * 1024 * 1024,
        help="Largest request body accepted; larger ones get 413.",
    )
    p.add_argument("--log-level", default="info", choices=_LOG_LEVELS, help="Logging level.")
    p.add_argument(
        "--access-log", action="store_true", help="Log one line per HTTP request (costs CPU)."
    )


def _upstream_flags(p: argparse.ArgumentParser) -> None:
    def number(flag: str, kind: type, default: float, text: str) -> None:
        p.add_argument(flag, type=kind, default=default, help=text)

    number(
        "--connect-timeout-secs", float, 5.0, "Seconds to wait for a TCP connection to an engine."
    )
    number(
        "--request-timeout-secs",
        float,
        600.0,
        "Seconds an engine may stay silent (before its answer or between two chunks).",
    )
    number("--max-connections", int, 0, "Cap on upstream connections in total (0 = no cap).")
    number(
        "--max-connections-per-host", int, 0, "Cap on upstream connections per engine (0 = no cap)."
    )
    number(
        "--keepalive-expiry-secs",
        float,
        4.0,
        "Idle pooled connections are closed after this, below vLLM's 5 s keep-alive.",
    )


def _number(
    p: argparse.ArgumentParser, flags: Sequence[str], kind: type, default: float, text: str
) -> None:
    p.add_argument(*flags, type=kind, default=default, help=text)


def _retry_flags(p: argparse.ArgumentParser) -> None:
    d = RetryConfig()
    t = Timeouts()
    _number(
        p,
        ("--max-retries", "--retry-max-retries"),
        int,
        d.max_retries,
        "Retries of a failed leg on another instance before the response starts (0: none).",
    )
    _number(
        p,
        ("--prefill-timeout-secs",),
        float,
        t.prefill,
        "Seconds a prefill leg may take in all before it is retried elsewhere.",
    )
    _number(
        p,
        ("--decode-header-timeout-secs",),
        float,
        t.decode_headers,
        "Seconds to wait for a streaming decode's response headers before retrying elsewhere.",
    )
    _number(
        p,
        ("--retry-budget-ratio",),
        float,
        d.budget_ratio,
        "Retries allowed as a share of the requests of the last 10 s, fleet-wide.",
    )
    _number(
        p,
        ("--retry-budget-min-per-sec",),
        float,
        d.budget_min_per_sec,
        "Retries per second always allowed on top of the ratio.",
    )
    _number(
        p,
        ("--retry-initial-backoff-ms",),
        float,
        d.initial_backoff * 1000,
        "Backoff before retrying once every instance of a role was tried.",
    )
    _number(p, ("--retry-max-backoff-ms",), float, d.max_backoff * 1000, "Longest such backoff.")


def _health_flags(p: argparse.ArgumentParser) -> None:
    d = HealthConfig()
    o = OutlierConfig()
    _number(
        p,
        ("--health-check-interval-secs",),
        float,
        d.interval,
        "Seconds between active health checks of every instance (0: off).",
    )
    _number(p, ("--health-check-timeout-secs",), float, d.timeout, "Timeout of one health check.")
    _number(
        p,
        ("--health-failure-threshold",),
        int,
        d.failure_threshold,
        "Failed checks in a row that make an instance unhealthy (not routable).",
    )
    _number(
        p,
        ("--health-success-threshold",),
        int,
        d.success_threshold,
        "Passed checks in a row that make an unhealthy instance healthy again.",
    )
    p.add_argument(
        "--health-check-endpoint", default=d.endpoint, help="Path the health checks GET."
    )
    _number(
        p,
        ("--outlier-consecutive-failures", "--cb-failure-threshold"),
        int,
        o.consecutive_failures,
        "Failed legs in a row that eject an instance from rotation (0: never eject).",
    )
    _number(
        p,
        ("--outlier-base-ejection-secs", "--cb-timeout-duration-secs"),
        float,
        o.base_ejection,
        "First ejection's length; it doubles on each re-ejection.",
    )
    _number(p, ("--outlier-max-ejection-secs",), float, o.max_ejection, "Longest ejection.")
    _number(
        p,
        ("--overload-cooldown-secs",),
        float,
        o.overload_cooldown,
        "After an engine answers 429 or 408, send new requests to its peers first this long.",
    )
    _number(
        p,
        ("--max-ejection-percent",),
        float,
        o.max_ejection_percent,
        "Most of a role's instances ejected at once, in percent (never the last one).",
    )


def _registry_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--registry-port",
        type=int,
        default=None,
        help="ZMQ registry port engines register with (off unless given; e.g. 30001, 36367).",
    )
    p.add_argument("--registry-host", default="0.0.0.0", help="Address the ZMQ registry binds to.")
    p.add_argument(
        "--registry-allow-cidr",
        nargs="+",
        action="extend",
        default=None,
        metavar="CIDR",
        help="Networks heartbeats are accepted from (default: any).",
    )
    p.add_argument(
        "--registry-max-message-bytes",
        type=int,
        default=64 * 1024,
        help="Largest registration message; a peer sending a larger one is disconnected.",
    )
    p.add_argument(
        "--registry-ttl",
        type=float,
        default=5.0,
        help="Seconds after its last heartbeat a registered instance is forgotten.",
    )


def _admin_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--admin-api-key-file",
        default=None,
        help="File holding the admin API key (else $ADMIN_API_KEY; with neither, admin is off).",
    )
    p.add_argument(
        "--admin-allow-cidr",
        nargs="+",
        action="extend",
        default=None,
        metavar="CIDR",
        help="Networks the admin API may add instances from (default: any).",
    )


def _security_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-key",
        nargs="+",
        action="extend",
        default=None,
        metavar="KEY",
        help="Keys clients must send as 'Authorization: Bearer KEY' (as vLLM's --api-key); "
        "prefer --api-key-file or PDPROXY_API_KEY, which stay out of ps.",
    )
    p.add_argument("--api-key-file", default=None, help="File of client keys, one per line.")
    p.add_argument(
        "--protect-metrics", action="store_true", help="/metrics needs a client key too."
    )
    p.add_argument(
        "--engine-api-key",
        default=None,
        help="Key pdproxy sends to engines started with vLLM's --api-key (then the client's "
        "Authorization is not passed on); prefer --engine-api-key-file.",
    )
    p.add_argument("--engine-api-key-file", default=None, help="File holding --engine-api-key.")
    p.add_argument("--ssl-keyfile", default=None, help="Private key of pdproxy's HTTPS listener.")
    p.add_argument("--ssl-certfile", default=None, help="Certificate of the HTTPS listener.")
    p.add_argument("--ssl-ca-certs", default=None, help="CA that signs client certificates.")
    p.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        choices=(0, 1, 2),
        help="Client certificates: 0 none, 1 optional, 2 required (as uvicorn and vLLM).",
    )
    p.add_argument(
        "--engine-ca-certs", default=None, help="CA of https:// engines (else the system's)."
    )
    p.add_argument("--engine-client-cert", default=None, help="Client certificate for mTLS.")
    p.add_argument("--engine-client-key", default=None, help="Its private key.")


def _lifecycle_flags(p: argparse.ArgumentParser) -> None:
    d = AdmissionConfig()
    _number(
        p,
        ("--max-concurrent-requests",),
        int,
        d.max_concurrent,
        "Client requests served at once (0: no limit); more wait in the queue.",
    )
    _number(
        p,
        ("--max-queued-requests",),
        int,
        d.max_queued,
        "Requests that may wait for a slot; more get 429 at once.",
    )
    _number(
        p,
        ("--queue-timeout-secs",),
        float,
        d.queue_timeout,
        "Longest wait for a slot before a 429.",
    )
    _number(
        p,
        ("--shutdown-timeout-secs",),
        float,
        30.0,
        "On SIGTERM, how long requests in flight may finish before their streams are ended.",
    )


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
        elif action.const is True:
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
        transfer_mode=args.transfer_mode,
        admin_api_key=_admin_key(args, environ),
        admin_allow_cidrs=tuple(args.admin_allow_cidr or ()),
        api_keys=_client_keys(args),
        protect_metrics=args.protect_metrics,
        engine_api_key=_engine_key(args),
        admission=AdmissionConfig(
            max_concurrent=args.max_concurrent_requests,
            max_queued=args.max_queued_requests,
            queue_timeout=args.queue_timeout_secs,
        ),
        shutdown_timeout=args.shutdown_timeout_secs,
        kv_connector=args.kv_connector,
        model=args.model,
        max_body_bytes=args.max_body_bytes,
        timeouts=Timeouts(
            connect=args.connect_timeout_secs,
            read=args.request_timeout_secs,
            prefill=args.prefill_timeout_secs,
            decode_headers=args.decode_header_timeout_secs,
        ),
        retry=RetryConfig(
            max_retries=args.max_retries,
            budget_ratio=args.retry_budget_ratio,
            budget_min_per_sec=args.retry_budget_min_per_sec,
            initial_backoff=args.retry_initial_backoff_ms / 1000,
            max_backoff=args.retry_max_backoff_ms / 1000,
        ),
        health=HealthConfig(
            interval=args.health_check_interval_secs,
            timeout=args.health_check_timeout_secs,
            failure_threshold=args.health_failure_threshold,
            success_threshold=args.health_success_threshold,
            endpoint=args.health_check_endpoint,
        ),
        outlier=OutlierConfig(
            consecutive_failures=args.outlier_consecutive_failures,
            base_ejection=args.outlier_base_ejection_secs,
            max_ejection=args.outlier_max_ejection_secs,
            max_ejection_percent=args.max_ejection_percent,
            overload_cooldown=args.overload_cooldown_secs,
        ),
        pool=PoolLimits(
            max_connections=args.max_connections,
            max_connections_per_host=args.max_connections_per_host,
            keepalive_expiry=args.keepalive_expiry_secs,
        ),
        registry=RegistryConfig(
            port=args.registry_port,
            host=args.registry_host,
            ttl=args.registry_ttl,
            allow_cidrs=tuple(args.registry_allow_cidr or ()),
            max_message_bytes=args.registry_max_message_bytes,
        ),
        tls=ListenerTLS(
            keyfile=args.ssl_keyfile,
            certfile=args.ssl_certfile,
            ca_certs=args.ssl_ca_certs,
            cert_reqs=args.ssl_cert_reqs,
        ),
        engine_tls=EngineTLS(
            ca_certs=args.engine_ca_certs,
            certfile=args.engine_client_cert,
            keyfile=args.engine_client_key,
        ),
        log_level=args.log_level,
        access_log=args.access_log,
    )


def parse_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> ProxyConfig:
    parser = build_parser()
    environ = os.environ if environ is None else environ
    _apply_env(parser, environ)
    args = parser.parse_args(argv)
    try:
        return config_from_args(args, environ)
    except ConfigError as exc:
        parser.error(str(exc))
    raise AssertionError("unreachable")  # parser.error exits


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    from pdproxy.api.app import create_app
    from pdproxy.server import DrainingServer

    config = parse_config(argv)
    configure_logging(config.log_level)
    logging.getLogger(__name__).info(
        "pdproxy on %s:%d, connector %s, %d prefill, %d decode",
        config.host,
        config.port,
        config.kv_connector,
        len(config.prefill),
        len(config.decode),
    )
    app = create_app(config)
    state = app.state.pdproxy
    server_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop="uvloop" if sys.platform != "win32" else "asyncio",
        http="httptools",
        log_level=config.log_level,
        access_log=config.access_log,
        log_config=None,
        # pdproxy logs no client addresses, so X-Forwarded-For parsing is wasted work.
        proxy_headers=False,
        # The drain has already ended every request when uvicorn's own shutdown starts.
        timeout_graceful_shutdown=5,
        ssl_keyfile=config.tls.keyfile,
        ssl_certfile=config.tls.certfile,
        ssl_ca_certs=config.tls.ca_certs,
        ssl_cert_reqs=config.tls.cert_reqs,
    )
    DrainingServer(server_config, lambda: state.lifecycle.drain(config.shutdown_timeout)).run()
