"""Routing and handlers: vLLM's OpenAI surface plus the /sim/* debug endpoints."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import Any

import orjson

from engines.sim import generate, metrics, openai_api, pooling, responses, scale_out
from engines.sim.config import Faults, SimConfig
from engines.sim.engine import Engine
from engines.sim.errors import ApiError, RequestValidationError, error_body
from engines.sim.http import Request
from engines.sim.lora import ServedModels, parse_lora_modules
from engines.sim.records import Recorder, RequestRecord

JSON = "application/json"
RESPONSES_PATH = "/v1/responses"
NOT_FOUND = b'{"detail":"Not Found"}'
NOT_ALLOWED = b'{"detail":"Method Not Allowed"}'
# The endpoints answered whole by one pure function of the request.
SINGLE: dict[str, pooling.Handler] = {**pooling.HANDLERS, **scale_out.HANDLERS}


class SimApp:
    """The HTTP side of one sim engine; `on_faults` lets the server react (listener on/off)."""

    def __init__(self, config: SimConfig, engine: Engine) -> None:
        self.config = config
        self.engine = engine
        self.recorder = Recorder(config.record_limit)
        self.served = ServedModels(
            (config.model, *config.served_models),
            parse_lora_modules(config.lora_modules),
            config.max_model_len,
        )
        self.responses = responses.ResponseStore(config.responses_store)
        self.faults = config.faults
        self.faults_set_at = time.monotonic()
        self.on_faults: Callable[[Faults], None] = lambda faults: None
        self.routes: dict[tuple[str, str], Callable[[Request], None]] = {
            ("GET", "/health"): self.health,
            ("GET", "/ping"): self.health,
            ("GET", "/v1/models"): self.models,
            ("POST", "/v1/load_lora_adapter"): self.load_lora,
            ("POST", "/v1/unload_lora_adapter"): self.unload_lora,
            ("GET", "/metrics"): self.metrics,
            ("GET", "/version"): self.version,
            ("GET", "/sim/requests"): self.get_requests,
            ("DELETE", "/sim/requests"): self.clear_requests,
            ("GET", "/sim/faults"): self.get_faults,
            ("POST", "/sim/faults"): self.post_faults,
            ("DELETE", "/sim/faults"): self.delete_faults,
            ("GET", "/sim/counters"): self.counters,
        }

    def set_faults(self, faults: Faults) -> None:
        self.faults = faults
        self.faults_set_at = time.monotonic()
        self.on_faults(faults)

    def handle(self, req: Request) -> None:
        if req.path in openai_api.KIND_BY_PATH:
            if req.method != "POST":
                req.conn.send(405, NOT_ALLOWED)
                return
            self.generation(req)
            return
        if req.path in SINGLE or req.path == RESPONSES_PATH:
            if req.method != "POST":
                req.conn.send(405, NOT_ALLOWED)
                return
            self.single(req)
            return
        route = self.routes.get((req.method, req.path))
        if route is None:
            known = any(path == req.path for _, path in self.routes)
            req.conn.send(405 if known else 404, NOT_ALLOWED if known else NOT_FOUND)
            return
        if not req.path.startswith("/sim/"):
            self.recorder.add(req.method, req.path, req.headers, None).complete()
        route(req)

    # OpenAI surface
    def generation(self, http: Request) -> None:
        rec = self.recorder.add(http.method, http.path, http.headers, None)
        self.engine.counters.requests_received += 1
        delay = float(self.faults.headers_delay_s)
        if delay > 0:
            then = functools.partial(self._generation, http, rec)
            generate.spawn_delayed(self.engine, http.conn, rec, delay, then)
            return
        self._generation(http, rec)

    def _generation(self, http: Request, rec: RequestRecord) -> None:
        try:
            body = openai_api.load_json(http.body)
        except ApiError as exc:
            _refuse(http, rec, exc)
            return
        rec.body = body
        try:
            job = self._job(http, body, rec)
        except ApiError as exc:
            _refuse(http, rec, exc)
            if not isinstance(exc, RequestValidationError):
                self._rejected(body)
            return
        if job is None:
            return
        if self.faults.hang:
            generate.spawn(job, generate.serve_hang(job))
        elif generate.can_inline(job):
            generate.serve_inline(job)
        else:
            generate.spawn(job, generate.serve_async(job))

    def _job(self, http: Request, body: dict[str, Any], rec: RequestRecord) -> generate.Job | None:
        if self.engine.dead is not None:
            rec.fail(500, f"engine dead: {self.engine.dead}")
            http.conn.send(500, error_body(500, generate.DEAD))
            return None
        if self.faults.status is not None:
            status = int(self.faults.status)
            rec.fail(status, "fault: status")
            http.conn.send(status, error_body(status, f"Simulated failure (HTTP {status})."))
            return None
        cfg = self.config
        kind = openai_api.KIND_BY_PATH[http.path]
        gen = openai_api.parse(
            kind, body, http.headers, self.served, cfg.max_model_len, cfg.dp_size
        )
        violation = contract_violation(cfg, gen)
        if violation:
            self.engine.counters.contract_violations += 1
            if cfg.strict:
                raise ApiError(400, f"pdproxy-sim contract violation: {violation}")
        return generate.Job(self.engine, http.conn, gen, rec, self.faults)

    def _rejected(self, body: dict[str, Any]) -> None:
        """The handler refused a request: a decode's prefill may free its KV at once.

        vLLM's `_with_kv_transfer_rejection_cleanup`; the answer is already sent.
        """
        params = body.get("kv_transfer_params")
        if isinstance(params, dict) and params.get("do_remote_prefill"):
            self.engine.connector.reject(params)

    def single(self, http: Request) -> None:
        """One of the endpoints vLLM serves on the instance alone (no KV transfer):
        tokenize, render, embeddings, pooling, score, rerank, responses."""
        rec = self.recorder.add(http.method, http.path, http.headers, None)
        delay = float(self.faults.headers_delay_s)
        if delay > 0:
            then = functools.partial(self._single, http, rec)
            generate.spawn_delayed(self.engine, http.conn, rec, delay, then)
            return
        self._single(http, rec)

    def _single(self, http: Request, rec: RequestRecord) -> None:
        faults, conn = self.faults, http.conn
        try:
            rec.body = body = openai_api.load_json(http.body)
            if faults.status is not None:
                status = int(faults.status)
                raise ApiError(status, f"Simulated failure (HTTP {status}).")
            if faults.hang:
                generate.spawn_hang(self.engine, conn, rec)
                return
            if http.path == RESPONSES_PATH:
                self._responses(http, body, rec)
                return
            answer = SINGLE[http.path](body, http.headers, self.config)
        except ApiError as exc:
            _refuse(http, rec, exc)
            return
        limit = faults.reset_after_bytes
        if limit is not None:
            rec.fail(200, f"fault: reset after {limit} bytes")
            conn.send_truncated(200, answer.body, int(limit), answer.content_type)
            return
        conn.send(200, answer.body, answer.content_type, answer.headers)
        rec.complete()

    def _responses(self, http: Request, body: dict[str, Any], rec: RequestRecord) -> None:
        call = responses.parse(body, http.headers, self.config, self.responses)
        self.engine.counters.requests_received += 1
        job = generate.Job(self.engine, http.conn, call.req, rec, self.faults)
        generate.spawn(job, responses.serve(job, call, self.responses))

    def health(self, req: Request) -> None:
        delay = float(self.faults.health_delay_s)
        if delay > 0:
            req.conn.spawn(self._health_later(req, delay))  # cancelled if the client leaves
            return
        req.conn.send(self._health_status(), b"")

    async def _health_later(self, req: Request, delay: float) -> None:
        await asyncio.sleep(delay)
        req.conn.send(self._health_status(), b"")

    def _health_status(self) -> int:
        if self.engine.dead is not None:
            return 503
        slow = float(self.faults.slow_start_s)
        if slow > 0 and time.monotonic() - self.faults_set_at < slow:
            return 503
        status = self.faults.health_status
        return 200 if status is None else int(status)

    def models(self, req: Request) -> None:
        cards = self.served.cards()
        req.conn.send(200, orjson.dumps({"object": "list", "data": cards}))

    def load_lora(self, req: Request) -> None:
        self._lora(req, self.served.load)

    def unload_lora(self, req: Request) -> None:
        self._lora(req, self.served.unload)

    def _lora(self, req: Request, change: Callable[[dict[str, Any]], str]) -> None:
        """vLLM's runtime LoRA endpoints: a plain-text line on success, else its error."""
        try:
            line = change(openai_api.load_json(req.body))
        except ApiError as exc:
            req.conn.send(exc.status, exc.body())
            return
        req.conn.send(200, line.encode(), "text/plain; charset=utf-8")

    def metrics(self, req: Request) -> None:
        text = metrics.render(self.engine.counters, self.engine.gauges(), self.config.model)
        req.conn.send(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

    def version(self, req: Request) -> None:
        req.conn.send(200, b'{"version":"0.33.0+sim"}')

    # /sim debug endpoints
    def get_requests(self, req: Request) -> None:
        data = [r.as_dict() for r in self.recorder.all()]
        req.conn.send(200, orjson.dumps(data))

    def clear_requests(self, req: Request) -> None:
        self.recorder.clear()
        req.conn.send(200, b"{}")

    def get_faults(self, req: Request) -> None:
        req.conn.send(200, orjson.dumps(self.faults.as_dict()))

    def post_faults(self, req: Request) -> None:
        try:
            faults = Faults.from_dict(openai_api.load_json(req.body))
        except (ApiError, ValueError, TypeError) as exc:
            req.conn.send(400, error_body(400, str(exc)))
            return
        req.conn.send(200, orjson.dumps(faults.as_dict()))
        self.set_faults(faults)

    def delete_faults(self, req: Request) -> None:
        req.conn.send(200, orjson.dumps(Faults().as_dict()))
        self.set_faults(Faults())

    def counters(self, req: Request) -> None:
        g = self.engine.gauges()
        data = {
            **self.engine.counters.as_dict(),
            "running": g.running,
            "waiting": g.waiting,
            "kv_usage": g.kv_usage,
            "kv_port": self.engine.connector.kv_port,
            "bootstrap_port": self.engine.connector.bootstrap_port,
        }
        req.conn.send(200, orjson.dumps(data))


def _refuse(http: Request, rec: RequestRecord, exc: ApiError) -> None:
    rec.fail(exc.status, exc.message)
    http.conn.send(exc.status, exc.body())


def contract_violation(cfg: SimConfig, gen: openai_api.GenRequest) -> str | None:
    """Why a prefill-leg request breaks the P-leg contract (PROTOCOLS.md 0.4), or None.

    Also what vLLM 0.32 cannot do across two legs (``pdproxy.scheduling.features``): ``n`` >
    1 on either leg (each forked choice holds or reads the same transfer) and prompt logprobs
    on a prefill (the decode recomputes the prompt)."""
    params = gen.kv_transfer_params or {}
    if gen.n > 1 and (params.get("do_remote_prefill") or params.get("do_remote_decode")):
        return f"n={gen.n} across two legs: every choice would read the same transfer"
    remote_decode = bool(params.get("do_remote_decode"))
    if not remote_decode and cfg.role != "prefill":
        return None
    body = gen.options  # a generate body's limits are in its sampling_params
    if body.get("max_tokens") != 1:
        return f"prefill leg must set max_tokens=1, got {body.get('max_tokens')!r}"
    mct = body.get("max_completion_tokens")
    if mct is not None and mct != 1:
        return f"prefill leg must set max_completion_tokens=1, got {mct!r}"
    if gen.stream:
        return "prefill leg must not stream"
    if body.get("prompt_logprobs") is not None:
        return "prefill leg with prompt_logprobs: the decode recomputes the prompt"
    if gen.n > 1:
        return f"prefill leg with n={gen.n}: only one choice's blocks would be handed over"
    return None
