"""uvicorn, with a graceful drain before its own shutdown.

uvicorn's SIGTERM handling closes the listener at once and, in this version, re-raises the
signal after shutdown (exit status 143). pdproxy's first SIGTERM or SIGINT instead starts
the drain (``Lifecycle.drain``): the listener stays open so ``/ready`` can answer 503 and new
requests are refused with 503, requests in flight finish within the grace, the rest are
ended; then uvicorn shuts down in its order (listener, connections, lifespan: registry
socket, health checks, background legs, pools) and the process exits 0. A second signal
during the drain is uvicorn's: SIGINT forces the exit.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import sys
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import uvicorn

from pdproxy.api.direct import fast_path_problem
from pdproxy.config.proxy import ProxyConfig
from pdproxy.runtime.listener import hardened_protocol

logger = logging.getLogger(__name__)


# Young collections every 700 net allocations (CPython's default) run several times per
# streamed request under load, each a pause every stream in the loop waits out; a request's
# garbage is short-lived and acyclic, so fewer, larger young collections cost less.
_GC_THRESHOLDS = (50_000, 20, 20)


def settle_garbage_collector() -> None:
    """Once serving: everything built at start-up (modules, app, pools) is moved out of the
    collector's generations (``gc.freeze``), so no collection walks it again, and young
    collections run less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*_GC_THRESHOLDS)


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        drain: Callable[[], Awaitable[None]],
        listening: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(config)
        self._drain = drain
        self._listening = listening  # told the bound port (--port 0 picks one)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self._listening is not None:
            for server in self.servers:
                for sock in server.sockets:
                    self._listening(sock.getsockname()[1])
        settle_garbage_collector()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining is not None or self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        # A signal handler runs between two bytecodes of the loop's thread: hand over.
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._draining is None:
            self._draining = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self._drain()
        except Exception:  # never stay up because the drain failed
            logger.exception("drain failed; shutting down")
        self.should_exit = True


def uvicorn_config(app: Any, config: ProxyConfig, **overrides: Any) -> uvicorn.Config:
    """uvicorn's settings for pdproxy's listener: the single process, every worker and the
    tests' ``running_proxy`` (``overrides``: its address and loop) all serve through the
    bounded protocol (``pdproxy.runtime.listener``) with ``config.clients``'s limits."""
    clients = config.clients
    problem = fast_path_problem()
    if problem is not None:
        logger.warning("streams go through ASGI, without the direct relay: %s", problem)
    settings: dict[str, Any] = {
        "host": config.host,
        "port": config.port,
        "loop": "uvloop" if sys.platform != "win32" else "asyncio",
        "http": hardened_protocol(clients),
        "ws": "none",  # pdproxy serves no WebSocket: an upgrade request stays plain HTTP
        "timeout_keep_alive": clients.keepalive_timeout,
        "log_level": config.log_level,
        "access_log": False,  # pdproxy writes its own access line (pdproxy.access)
        "log_config": None,  # uvicorn's loggers propagate to pdproxy's handler and format
        # pdproxy logs no client addresses, so X-Forwarded-For parsing is wasted work.
        "proxy_headers": False,
        # The drain has already ended every request when uvicorn's own shutdown starts.
        "timeout_graceful_shutdown": 5,
        "ssl_keyfile": config.tls.keyfile,
        "ssl_certfile": config.tls.certfile,
        "ssl_ca_certs": config.tls.ca_certs,
        "ssl_cert_reqs": config.tls.cert_reqs,
    }
    return uvicorn.Config(app, **{**settings, **overrides})
