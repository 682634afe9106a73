"""``create_app``: builds every stateful object and wires the lifespan."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from starlette.routing import Route
from starlette.types import ASGIApp

from pdproxy.api.info import router as info_router
from pdproxy.api.openai import GenerationEndpoint, HotPathDispatch
from pdproxy.api.state import AppState
from pdproxy.config import ProxyConfig
from pdproxy.connectors import load_connector
from pdproxy.engine_client import EngineClient
from pdproxy.metrics import ProxyMetrics
from pdproxy.orchestrator import Orchestrator
from pdproxy.registry import EndpointRegistry
from pdproxy.scheduling.round_robin import RoundRobinScheduler
from pdproxy.types import ApiKind, Role


def create_app(
    config: ProxyConfig,
    *,
    clock: Callable[[], float] = time.monotonic,
    metrics_registry: CollectorRegistry | None = None,
) -> FastAPI:
    registry = EndpointRegistry(clock)
    registry.add_static(Role.PREFILL, config.prefill)
    registry.add_static(Role.DECODE, config.decode)
    client = EngineClient(config.timeouts, config.pool)
    metrics = ProxyMetrics(metrics_registry or CollectorRegistry())
    orchestrator = Orchestrator(
        registry=registry,
        scheduler=RoundRobinScheduler(),
        connector=load_connector(config),
        client=client,
        metrics=metrics,
    )
    state = AppState(config, registry, client, metrics, orchestrator)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Startup: open the upstream pools before the first request can arrive.
        await client.start()
        try:
            yield
        finally:
            # Shutdown: uvicorn has stopped accepting and drained connections; cancel the
            # prefill legs still running in the background, then close the pools.
            await orchestrator.aclose()
            await client.aclose()

    metrics.track_in_flight(lambda: state.in_flight)
    hot_paths = {kind.path: GenerationEndpoint(kind, state) for kind in ApiKind}
    app = _ProxyApp(hot_paths, title="pdproxy", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.pdproxy = state
    for path, endpoint in hot_paths.items():
        # Also routed normally, so the OpenAPI schema and 405s stay right.
        app.router.routes.append(Route(path, endpoint, methods=["POST"]))
    app.include_router(info_router)
    return app


class _ProxyApp(FastAPI):
    def __init__(self, hot_paths: dict[str, GenerationEndpoint], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._hot_paths = hot_paths

    def build_middleware_stack(self) -> ASGIApp:
        return HotPathDispatch(self._hot_paths, super().build_middleware_stack())
