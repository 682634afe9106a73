"""argv and ``PDPROXY_*`` environment → ``ProxyConfig`` → uvicorn. Nothing else.

Every flag can also be set from the environment: ``--kv-connector`` is
``PDPROXY_KV_CONNECTOR``; list flags take space- or comma-separated values. Flags win over
the environment. The admin key has no flag (it would show in ps): ``--admin-api-key-file``,
else ``PDPROXY_ADMIN_API_KEY``, else ``ADMIN_API_KEY``. Invalid input exits with status 2 and
one clear line. The flags, their variables and their config fields are one table
(``pdproxy.cli.flags``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence

from pdproxy.cli.flag import ENV_PREFIX, apply_env, build_config
from pdproxy.cli.flags import FLAGS, build_parser
from pdproxy.config.proxy import ProxyConfig
from pdproxy.errors import ConfigError
from pdproxy.membership.discovery.shared import require_etcd
from pdproxy.observability.log import configure_logging
from pdproxy.observability.tracing import require_otel, traces_url

__all__ = ["ENV_PREFIX", "config_from_args", "main", "parse_config"]


def _apply_env(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Turn PDPROXY_* variables into parser defaults, so flags still override them."""
    apply_env(parser, FLAGS, environ)


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> ProxyConfig:
    """Build and validate the config; raises ``ConfigError`` with a one-line reason.
    ``environ`` is read only for the older unprefixed names (``ADMIN_API_KEY``)."""
    return build_config(FLAGS, args, environ)


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
