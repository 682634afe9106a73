"""The ASGI app: every handler on its route, the hot paths straight to theirs."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from pdproxy.api.admin import router as admin_router
from pdproxy.api.admin import tenants_router
from pdproxy.api.dashboard import Dashboard
from pdproxy.api.errors import error_response
from pdproxy.api.info import router as info_router
from pdproxy.api.lora import router as lora_router
from pdproxy.api.openai import GenerationEndpoint
from pdproxy.api.passthrough import PassthroughEndpoint
from pdproxy.api.state import AppState
from pdproxy.errors import ProxyError
from pdproxy.types import ApiKind
from pdproxy.wire.routes import ROUTES


def asgi_app(
    state: AppState,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]],
    dashboard: Dashboard | None,
) -> FastAPI:
    """The handlers of ``state`` on their routes; ``lifespan`` runs what serves beside them
    (``pdproxy.app`` builds both)."""
    generation = {kind.path: GenerationEndpoint(kind, state) for kind in ApiKind}
    passthrough = {r.path: PassthroughEndpoint(r, state) for r in ROUTES}
    hot_paths: dict[str, ASGIApp] = {
        **generation,
        **{path: e for path, e in passthrough.items() if e.route.method == "POST"},
    }
    app = _ProxyApp(hot_paths, title="pdproxy", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.pdproxy = state
    _mount(app, generation, passthrough, dashboard)
    return app


def _mount(
    app: FastAPI,
    generation: dict[str, GenerationEndpoint],
    passthrough: dict[str, PassthroughEndpoint],
    dashboard: Dashboard | None,
) -> None:
    # The hot paths are also routed normally, so the OpenAPI schema and 405s stay right.
    for path, endpoint in generation.items():
        app.router.routes.append(Route(path, endpoint, methods=["POST"]))
    for path, passthrough_endpoint in passthrough.items():
        app.router.routes.append(
            Route(path, passthrough_endpoint, methods=[passthrough_endpoint.route.method])
        )
    app.include_router(info_router)
    app.include_router(lora_router)
    app.include_router(admin_router)
    app.include_router(tenants_router)
    if dashboard is not None:
        dashboard.mount(app)
    app.add_exception_handler(ProxyError, _proxy_error)


async def _proxy_error(request: Request, exc: Exception) -> Response:
    if not isinstance(exc, ProxyError):
        raise exc
    return error_response(exc)


class _ProxyApp(FastAPI):
    """FastAPI for everything but the generation (and POST pass-through) endpoints, which go
    straight to their handlers: FastAPI's own ``__call__`` and middleware stack cost a dozen
    ASGI layers and an environment lookup per request, a measurable share of the proxy's
    CPU."""

    def __init__(self, hot_paths: dict[str, ASGIApp], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._hot_paths = hot_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self._hot_paths.get(scope["path"])
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await super().__call__(scope, receive, send)
