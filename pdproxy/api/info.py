"""Read-only endpoints: liveness, the vLLM-demo-compatible status, models, metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdproxy.api.errors import json_response
from pdproxy.api.state import AppState
from pdproxy.errors import Unauthorized, UpstreamError
from pdproxy.observability.workers_view import ProxyFigures
from pdproxy.resilience.outlier import OutlierDetector
from pdproxy.types import BreakerState, Endpoint, EngineLoad, Role

logger = logging.getLogger(__name__)

router = APIRouter()


def _state(request: Request) -> AppState:
    state: AppState = request.app.state.pdproxy
    return state


@router.get("/health")
async def health() -> Response:
    """Liveness: the proxy process serves HTTP."""
    return Response(status_code=200)


@router.get("/ready")
async def ready(request: Request) -> Response:
    """Readiness: a prefill and a decode are routable and the proxy is not draining."""
    ok, reason = _state(request).lifecycle.ready()
    return json_response({"ready": ok, "reason": reason}, status=200 if ok else 503)


def authorize(state: AppState, request: Request) -> None:
    """Raises ``Unauthorized`` without a client API key when keys are set."""
    if state.keys.enabled and not state.keys.allows(request.headers.get("authorization")):
        raise Unauthorized("invalid or missing API key (Authorization: Bearer KEY)")


@router.get("/status")
async def status(request: Request) -> Response:
    """Same keys as vLLM's disagg_proxy_demo.py, plus per-instance health detail; the
    in-flight figures are the whole proxy's (under ``--workers``, summed over every worker)."""
    state = _state(request)
    endpoints, now = state.registry.all(), state.clock()
    prefill = [e.address.host_port for e in endpoints if e.role is Role.PREFILL]
    decode = [e.address.host_port for e in endpoints if e.role is Role.DECODE]
    whole = whole_proxy(state)
    instances = [describe(e, state.outliers, now=now) for e in endpoints]
    body: dict[str, Any] = {
        "prefill_node_count": len(prefill),
        "decode_node_count": len(decode),
        "prefill_nodes": prefill,
        "decode_nodes": decode,
        "instances": whole.count_legs(instances),
        "in_flight": whole.in_flight,
        "queue_depth": whole.queue_depth,
        "models": model_pools(state),
        "lora": dataclasses.asdict(state.lora.counts),
        "registry_backend": (
            {"backend": "in-process", "up": True}
            if state.registry_backend is None
            else state.registry_backend()
        ),
    }
    flow = flow_status(state)
    if flow is not None:
        body["flow"] = flow
    if state.kv_events is not None:  # --kv-events-endpoint: the index and its subscribers
        body["kv_events"] = state.kv_events.status()
    push = state.orchestrator.push_status()
    if push is not None:  # --kv-connector nixl-push
        body["push"] = push
    body.update(whole.workers_dict())
    return json_response(body)


def flow_status(state: AppState) -> dict[str, Any] | None:
    """``/status``'s ``flow`` section (the dashboard's queue panel too), under a tenants
    file or a tenant header (``--tenants``, ``--tenant-header``); None without. It is the
    answering process's ``FlowBook``: under ``--workers``, one worker's queue."""
    admission = state.admission
    if admission is None or not admission.tenants.enabled:
        return None
    return admission.book.status()


@dataclasses.dataclass(frozen=True, slots=True)
class WholeProxy:
    """The proxy's in-flight figures: a single process's own, or under ``--workers`` every
    worker's from the multiprocess files (``pdproxy.observability.workers_view``)."""

    in_flight: int
    queue_depth: int
    figures: ProxyFigures | None = None  # --workers: each worker's
    answering: dict[str, int] | None = None  # --workers: the worker that answers

    def count_legs(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``describe``'s rows with every worker's legs (a single process's are its own)."""
        if self.figures is not None:
            for row in rows:
                row["in_flight"] = self.figures.legs(row["url"])
        return rows

    def workers_dict(self) -> dict[str, Any]:
        """``worker`` (the answering one) and ``workers`` (each one's figures), under
        ``--workers``; nothing in a single process."""
        if self.figures is None or self.answering is None:
            return {}
        return {
            "worker": self.answering,
            "workers": [w.as_dict() for w in self.figures.workers],
        }


def whole_proxy(state: AppState) -> WholeProxy:
    if state.worker_gauges is None or state.owner_link is None:
        queued = state.admission.queued if state.admission is not None else 0
        return WholeProxy(state.in_flight.count, queued)
    figures = state.worker_gauges.whole()
    spec = state.owner_link.spec
    answering = {"pid": os.getpid(), "index": spec.index, "workers": spec.count}
    return WholeProxy(figures.in_flight, figures.queue_depth, figures, answering)


def model_pools(state: AppState) -> dict[str, dict[str, list[str]]]:
    """Each served model's pool: the routable prefills and decodes that may take it."""
    return {
        model: {
            "prefill": [e.address.host_port for e in pool.prefill],
            "decode": [e.address.host_port for e in pool.decode],
        }
        for model, pool in state.registry.pools().by_model.items()
    }


def describe(
    endpoint: Endpoint, outliers: OutlierDetector, *, now: float | None = None
) -> dict[str, Any]:
    """One instance as ``/status`` and the admin API show it (never a secret); ``now`` is
    the monotonic time its load figures' age is measured from (None: no ``age_s``)."""
    address = endpoint.address
    health = endpoint.health
    breaker = outliers.state(endpoint)
    return {
        "role": endpoint.role.value,
        "address": address.host_port,
        "url": address.url,
        "state": endpoint.state.value,
        "source": endpoint.source.value,
        "routable": endpoint.routable and breaker is not BreakerState.OPEN,
        "health": health.probe.value,
        "breaker": breaker.value,
        "consecutive_failures": health.consecutive_failures,
        "ejections": health.ejections_total,
        "stranded": outliers.stranded(endpoint),  # nixl-push: its KV may have leaked
        "in_flight": endpoint.legs.in_flight,
        "last_heartbeat": endpoint.presence.last_seen,
        "zmq_address": address.zmq_address,
        "dp_size": endpoint.dp_size,
        "tp_size": address.tp_size,
        "transfer_mode": address.transfer_mode,
        "models": list(endpoint.models),
        "engine_load": describe_load(endpoint.load.engine_load, now),
    }


def describe_load(load: EngineLoad | None, now: float | None) -> dict[str, Any] | None:
    """The engine's last scraped figures, however old (``age_s`` says), or None: the one
    rendering of an engine's load, in ``/status`` and (with its freshness) the dashboard."""
    if load is None:
        return None
    return {
        "running": load.running,
        "waiting": load.waiting,
        "kv_usage": load.kv_usage,
        "age_s": None if now is None else round(max(0.0, now - load.scraped_at), 3),
        "ranks": [
            {"rank": r.rank, "running": r.running, "waiting": r.waiting, "kv_usage": r.kv_usage}
            for r in load.ranks
        ],
    }


@router.get("/v1/models")
async def models(request: Request) -> Response:
    """The union of the models the instances serve; an instance that fails is skipped."""
    state = _state(request)
    authorize(state, request)
    endpoints = [e for e in state.registry.all() if e.routable]
    answers = await asyncio.gather(*(_models_of(state, e) for e in endpoints))
    by_id: dict[str, dict[str, Any]] = {}
    for cards in answers:
        for card in cards:
            by_id.setdefault(card["id"], card)
    return json_response({"object": "list", "data": list(by_id.values())})


async def _models_of(state: AppState, endpoint: Endpoint) -> list[dict[str, Any]]:
    try:
        answer = await state.client.get_json(endpoint.url + "/v1/models")
    except (UpstreamError, ValueError):
        logger.warning("could not list models of %s", endpoint.url)
        return []
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        return []
    return [card for card in data if isinstance(card, dict) and isinstance(card.get("id"), str)]


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = _state(request)
    if state.config.protect_metrics:
        authorize(state, request)
    if state.worker_gauges is not None:  # --workers: this worker's part of the files
        state.worker_gauges.write()
    else:
        state.membership.refresh_gauges()  # health and breaker state as of this scrape
    return Response(
        generate_latest(state.exposition or state.metrics.registry), media_type=CONTENT_TYPE_LATEST
    )
