"""One ``--workers`` serving process: ``python -m pdproxy.runtime.child``.

The supervisor writes ``(ProxyConfig, WorkerSpec)`` to its stdin (pickled, through a pipe:
the config's keys never touch the disk) and sets ``PROMETHEUS_MULTIPROC_DIR`` in its
environment, which must hold before prometheus_client is imported. The worker binds its own
listening socket on the shared port with ``SO_REUSEPORT``, so the kernel spreads new
connections over the workers' sockets, and serves exactly as a single pdproxy does
(``DrainingServer``: SIGTERM drains, then exit 0), its membership following the owner's.
A worker that cannot start exits with ``BOOT_FAILURE`` (3, as uvicorn's startup failure).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import sys

from pdproxy.config.proxy import ProxyConfig
from pdproxy.config.workers import BOOT_FAILURE, METRICS_ENV, WorkerSpec
from pdproxy.observability.log import configure_logging


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) TCP socket that shares ``port`` with its siblings."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def main() -> None:
    config, spec = pickle.load(sys.stdin.buffer)
    assert isinstance(config, ProxyConfig) and isinstance(spec, WorkerSpec)
    if os.environ.get(METRICS_ENV) != spec.run_dir.metrics:
        raise SystemExit(f"{METRICS_ENV} must be {spec.run_dir.metrics}")
    configure_logging(config.log_level, config.log_format)
    # Imported only now: prometheus_client reads PROMETHEUS_MULTIPROC_DIR at import.
    from pdproxy.app import create_app
    from pdproxy.runtime.server import DrainingServer, uvicorn_config

    try:
        sock = listen_socket(config.host, spec.port)
        app = create_app(config, worker=spec)
    except Exception:
        logging.getLogger("pdproxy.runtime.child").exception(
            "worker %d could not start", spec.index + 1
        )
        sys.exit(BOOT_FAILURE)
    state = app.state.pdproxy
    server = DrainingServer(
        uvicorn_config(app, config), lambda: state.lifecycle.drain(config.shutdown_timeout)
    )
    try:
        server.run(sockets=[sock])
    except Exception:
        if server.started:
            raise
        logging.getLogger("pdproxy.runtime.child").exception(
            "worker %d could not start", spec.index + 1
        )
    if not server.started:  # its startup failed (a certificate, the owner's snapshot...)
        sys.exit(BOOT_FAILURE)


if __name__ == "__main__":
    main()
