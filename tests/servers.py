"""Real servers on loopback for the integration tiers (uvicorn's ``run_server`` pattern)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

from pdproxy.app import create_app
from pdproxy.config.proxy import ProxyConfig
from pdproxy.runtime.server import uvicorn_config


@dataclasses.dataclass
class RunningProxy:
    url: str
    app: object
    server: uvicorn.Server

    @property
    def state(self):
        return self.app.state.pdproxy


@contextlib.asynccontextmanager
async def running_proxy(config: ProxyConfig, **app_options: Any) -> AsyncIterator[RunningProxy]:
    """pdproxy under a real uvicorn on 127.0.0.1 and a free port, on the current loop, with
    the CLI's uvicorn settings (``pdproxy.runtime.server.uvicorn_config``); ``https://`` when
    ``config.tls`` is enabled.
    ``app_options`` go to ``create_app`` (a tracer, a metrics registry...)."""
    app = create_app(config, **app_options)
    tls = config.tls
    # The CLI's own settings (the bounded protocol, config.clients's limits), on this loop.
    local = dataclasses.replace(config, host="127.0.0.1", port=0)
    server = uvicorn.Server(uvicorn_config(app, local, loop="none", lifespan="on"))
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(500):
            if server.started or task.done():
                break
            await asyncio.sleep(0.01)
        if not server.started:
            raise RuntimeError("pdproxy did not start")
        port = server.servers[0].sockets[0].getsockname()[1]
        app.state.pdproxy.membership.listening(port)  # as pdproxy's own listener would
        scheme = "https" if tls.enabled else "http"
        yield RunningProxy(f"{scheme}://127.0.0.1:{port}", app, server)
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
