"""All of pdproxy's Prometheus metrics, on an injected registry (``pdproxy_`` prefix)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdproxy.observability.endpoint_in_flight import EndpointInFlight
from pdproxy.observability.flow_metrics import FlowMetrics
from pdproxy.observability.push_metrics import PushMetrics

_LEG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


# pdproxy_prompt_tokens_total's outcomes (pdproxy.proxying.prompt_tokens)
PROMPT_TOKEN_OUTCOMES = ("exact", "unsupported", "failed", "no_tokenizer")


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._request_children: dict[tuple[str, str], Any] = {}
        self._endpoint_labels: set[tuple[str, str]] = set()
        self._model_labels: set[tuple[str, str, str]] = set()
        self._latency_children: dict[str, tuple[Any, Any]] = {}
        self._leg_children: dict[tuple[str, str], Any] = {}
        self._failure_children: dict[tuple[str, str, str], Any] = {}
        self._define_requests(registry)
        self._define_legs(registry)
        self._define_endpoints(registry)
        self._define_fleet(registry)
        self._define_resilience(registry)
        self._define_admission(registry)
        self._define_registry_backend(registry)
        self.push = PushMetrics(registry)  # --kv-connector nixl-push

    def _define_registry_backend(self, registry: CollectorRegistry) -> None:
        """--registry-backend: the shared registry (etcd) replicas build their own from."""
        self.registry_backend_up = Gauge(
            "pdproxy_registry_backend_up",
            "1 while the registry backend is reachable and in sync (always 1 in-process); 0"
            " while etcd is unreachable and the last membership seen is served.",
            registry=registry,
            # --workers: the owner's own and the workers' copies of it
            # (pdproxy.observability.multiproc)
            multiprocess_mode="livemin",
        )
        self.registry_backend_up.set(1)
        self.registry_backend_sync_age = Gauge(
            "pdproxy_registry_backend_sync_age_seconds",
            "Seconds since the last successful exchange with the registry backend (0 in-process).",
            registry=registry,
            multiprocess_mode="livemax",  # --workers: the workers' copies (the owner's is 0)
        )
        self.registry_backend_resyncs = Counter(
            "pdproxy_registry_backend_resyncs_total",
            "Full reconciles with the registry backend: the first, and one after each outage.",
            registry=registry,
        )
        self.registry_backend_pending = Gauge(
            "pdproxy_registry_backend_pending_writes",
            "What this replica learned and has not yet written to the registry backend.",
            registry=registry,
            multiprocess_mode="livemax",  # --workers: the workers' copies (the owner's is 0)
        )

    def _define_requests(self, registry: CollectorRegistry) -> None:
        """Client requests and their legs."""
        self.requests = Counter(
            "pdproxy_requests_total",
            "Client requests by endpoint and outcome (ok, client_disconnected, or the error type,"
            " mid-stream failures included).",
            ("endpoint", "outcome"),
            registry=registry,
        )
        self.prefill_seconds = Histogram(
            "pdproxy_prefill_duration_seconds",
            "Time from sending the prefill leg to its full answer.",
            registry=registry,
            buckets=_LEG_BUCKETS,
        )
        self.ttft_seconds = Histogram(
            "pdproxy_request_ttft_seconds",
            "Client's time to first byte: from the request's arrival to the first body byte"
            " sent back (the first SSE event of a stream, the whole body otherwise); answers"
            " with a status below 400.",
            ("endpoint",),
            registry=registry,
            buckets=_LEG_BUCKETS,
        )
        self.request_seconds = Histogram(
            "pdproxy_request_duration_seconds",
            "Client's end-to-end time: from the request's arrival to its last byte; answers"
            " with a status below 400.",
            ("endpoint",),
            registry=registry,
            buckets=_LEG_BUCKETS,
        )
        self.in_flight = Gauge(
            "pdproxy_requests_in_flight",
            "Client requests being served.",
            registry=registry,
            multiprocess_mode="livesum",  # pdproxy.runtime: summed over the workers
        )
        self.decode_only = Counter(
            "pdproxy_decode_only_requests_total",
            "Requests served by a decode alone, without a prefill, by reason: short_prompt"
            " (under --pd-threshold-tokens), no_prefill (--decode-only-fallback),"
            " parallel_sampling (n/best_of > 1) or prompt_logprobs (vLLM cannot split them).",
            ("reason",),
            registry=registry,
        )
        self.render_once = Counter(
            "pdproxy_render_once_requests_total",
            "Text requests under --render-once, by how they were served: rendered (render,"
            " then both legs on token ids) or the text path's reason (tools, logprobs, ...).",
            ("served",),
            registry=registry,
        )
        self.kv_params_missing = Counter(
            "pdproxy_kv_params_missing_total",
            "Prefill answers that carried no kv_transfer_params (the decode recomputed).",
            registry=registry,
        )

    def _define_legs(self, registry: CollectorRegistry) -> None:
        """Latency of the legs as the proxy sees it (the prefill's is in _define_requests)."""
        self.decode_headers_seconds = Histogram(
            "pdproxy_decode_headers_seconds",
            "Time from sending a streaming decode leg to its response headers.",
            registry=registry,
            buckets=_LEG_BUCKETS,
        )
        self.kv_handoff_seconds = Histogram(
            "pdproxy_kv_handoff_seconds",
            "Time from the prefill's answer to the streaming decode's first bytes (serial"
            " connectors): the KV transfer and the first decode step, as the proxy sees them.",
            registry=registry,
            buckets=_LEG_BUCKETS,
        )
        self.kv_events_cached_tokens = Counter(
            "pdproxy_kv_events_cached_tokens_total",
            "kv-events: prompt tokens the prefill's events predicted cached (predicted) and"
            " the prefill then found cached (actual), over the requests it checked.",
            ("kind",),
            registry=registry,
        )
        for kind in ("predicted", "actual"):
            self.kv_events_cached_tokens.labels(kind)
        self.kv_events_error_tokens = Counter(
            "pdproxy_kv_events_prediction_error_tokens_total",
            "kv-events: the absolute difference between predicted and actual cached tokens.",
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "pdproxy_prompt_tokens_total",
            "--tokenizer: text requests scored by kv-events, by how their prompt was"
            " tokenized: exact (scored on its token ids), unsupported (a shape the local"
            " tokenizer cannot reproduce), failed (the tokenizer raised), no_tokenizer (none"
            " for the model); all but exact are scored approximately.",
            ("outcome",),
            registry=registry,
        )
        for outcome in PROMPT_TOKEN_OUTCOMES:
            self.prompt_tokens.labels(outcome)

    def _define_endpoints(self, registry: CollectorRegistry) -> None:
        """Per instance (role, url); a departed instance's series are removed."""
        self.endpoint_requests = Counter(
            "pdproxy_endpoint_requests_total",
            "Request legs (prefill, decode) sent to an instance; KV release legs are not.",
            ("role", "url"),
            registry=registry,
        )
        self.endpoint_failures = Counter(
            "pdproxy_endpoint_failures_total",
            "Legs to an instance that failed, by reason: connect, timeout, reset, 5xx, 429,"
            " 408 (as pdproxy_retries_total), 4xx (the engine refused the request) or other.",
            ("role", "url", "reason"),
            registry=registry,
        )

    def _define_fleet(self, registry: CollectorRegistry) -> None:
        """Engine instances and the registry."""
        self.registry_messages = Counter(
            "pdproxy_registry_messages_total",
            "ZMQ registry messages by outcome.",
            ("outcome",),
            registry=registry,
        )
        self.registry_refused = Counter(
            "pdproxy_registry_refused_total",
            "Connections to the ZMQ registry refused: the peer is outside --registry-allow-cidr.",
            registry=registry,
        )
        self.registry_mutes = Counter(
            "pdproxy_registry_mutes_total",
            "ZMQ registry peers muted for sending malformed messages too fast (their messages"
            ' are then counted in pdproxy_registry_messages_total{outcome="muted"}).',
            registry=registry,
        )
        self.endpoints = Gauge(
            "pdproxy_endpoints",
            "Known engine instances by role and state.",
            ("role", "state"),
            registry=registry,
            multiprocess_mode="livemax",  # every process sees the same membership
        )
        self.endpoint_healthy = Gauge(
            "pdproxy_endpoint_healthy",
            "1 while an instance passes its active health checks, else 0.",
            ("role", "url"),
            registry=registry,
            multiprocess_mode="livemax",
        )
        self.endpoint_ejected = Gauge(
            "pdproxy_endpoint_ejected",
            "1 while an instance is ejected (breaker open or half-open), else 0.",
            ("role", "url"),
            registry=registry,
            multiprocess_mode="livemax",  # ejected by any worker
        )
        self.endpoint_model = Gauge(
            "pdproxy_endpoint_model",
            "1 for each model or LoRA adapter an instance serves (its /v1/models).",
            ("role", "url", "model"),
            registry=registry,
            multiprocess_mode="livemax",
        )
        self.engine_scrapes = Counter(
            "pdproxy_engine_scrapes_total",
            "Scrapes of the engines' /metrics for their load figures, by outcome (ok, error).",
            ("outcome",),
            registry=registry,
        )
        for outcome in ("ok", "error"):
            self.engine_scrapes.labels(outcome)  # both series exist from the start

    def _define_resilience(self, registry: CollectorRegistry) -> None:
        """Retries, ejections and released KV."""
        self.retries = Counter(
            "pdproxy_retries_total",
            "Legs retried on another instance before the client's response started, by leg"
            " and the failure that caused the retry (connect, timeout, reset, 5xx, 429, 408).",
            ("leg", "reason"),
            registry=registry,
        )
        self.retry_budget_exhausted = Counter(
            "pdproxy_retry_budget_exhausted_total",
            "Retry-safe leg failures that were not retried because the retry budget was spent.",
            ("leg",),
            registry=registry,
        )
        self.migrations = Counter(
            "pdproxy_migrations_total",
            "Streams cut mid-answer (reason: reset, timeout, drain, engine_error) and what became"
            " of them (outcome: migrated, failed, limit, budget, unreadable, finished).",
            ("reason", "outcome"),
            registry=registry,
        )
        self.ejections = Counter(
            "pdproxy_ejections_total",
            "Instances taken out of rotation by outlier ejection (passive health).",
            ("role", "url"),
            registry=registry,
        )
        self.released_kv = Counter(
            "pdproxy_released_kv_total",
            "Prefills whose KV no decode would read, released early on the engines, by outcome.",
            ("outcome",),
            registry=registry,
        )

    def _define_admission(self, registry: CollectorRegistry) -> None:
        """Admission control."""
        self.queue_depth = Gauge(
            "pdproxy_queue_depth",
            "Client requests waiting for an admission slot (--max-concurrent-requests).",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.admission_rejected = Counter(
            "pdproxy_admission_rejected_total",
            "Client requests refused with 429 by admission control, by reason"
            " (queue_full, queue_timeout).",
            ("reason",),
            registry=registry,
        )
        self.flow = FlowMetrics(registry, _LEG_BUCKETS)  # --tenants

    def count_request(self, endpoint: str, outcome: str) -> None:
        """Hot path: label children are cached, as ``labels()`` takes a lock per call."""
        child = self._request_children.get((endpoint, outcome))
        if child is None:
            child = self._request_children[(endpoint, outcome)] = self.requests.labels(
                endpoint, outcome
            )
        child.inc()

    def observe_request(self, endpoint: str, ttft: float, total: float) -> None:
        """The client's time to first byte and end-to-end time, in seconds (hot path)."""
        children = self._latency_children.get(endpoint)
        if children is None:
            children = self._latency_children[endpoint] = (
                self.ttft_seconds.labels(endpoint),
                self.request_seconds.labels(endpoint),
            )
        children[0].observe(ttft)
        children[1].observe(total)

    def count_leg(self, role: str, url: str) -> None:
        """A leg sent to an instance (hot path)."""
        child = self._leg_children.get((role, url))
        if child is None:
            child = self._leg_children[(role, url)] = self.endpoint_requests.labels(role, url)
        child.inc()

    def count_leg_failure(self, role: str, url: str, reason: str) -> None:
        key = (role, url, reason)
        child = self._failure_children.get(key)
        if child is None:
            child = self._failure_children[key] = self.endpoint_failures.labels(*key)
        child.inc()

    def count_decode_only(self, reason: str) -> None:
        self.decode_only.labels(reason).inc()

    def count_retry(self, leg: str, reason: str) -> None:
        self.retries.labels(leg, reason).inc()

    def count_scrape(self, ok: bool) -> None:
        self.engine_scrapes.labels("ok" if ok else "error").inc()

    def set_endpoint_health(self, rows: Iterable[tuple[str, str, bool, bool]]) -> None:
        """Per-instance gauges from ``(role, url, healthy, ejected)``; departed instances'
        series are removed so the label set stays bounded by the fleet."""
        seen = set()
        for role, url, healthy, ejected in rows:
            seen.add((role, url))
            self.endpoint_healthy.labels(role, url).set(1 if healthy else 0)
            self.endpoint_ejected.labels(role, url).set(1 if ejected else 0)
        for labels in self._endpoint_labels - seen:
            self.endpoint_healthy.remove(*labels)
            self.endpoint_ejected.remove(*labels)
        self._endpoint_labels = seen
        self._forget_departed(seen)

    def set_endpoint_models(self, rows: Iterable[tuple[str, str, tuple[str, ...]]]) -> None:
        """``pdproxy_endpoint_model`` from ``(role, url, models)``; a model an instance no
        longer serves (an adapter unloaded, an instance gone) loses its series."""
        seen = {(role, url, model) for role, url, models in rows for model in models}
        for labels in seen - self._model_labels:
            self.endpoint_model.labels(*labels).set(1)
        for labels in self._model_labels - seen:
            self.endpoint_model.remove(*labels)
        self._model_labels = seen

    def _forget_departed(self, present: set[tuple[str, str]]) -> None:
        """Drop the leg counters of instances no longer in the fleet."""
        for key in [k for k in self._leg_children if k not in present]:
            del self._leg_children[key]
            self.endpoint_requests.remove(*key)
        for fkey in [k for k in self._failure_children if k[:2] not in present]:
            del self._failure_children[fkey]
            self.endpoint_failures.remove(*fkey)

    def track_in_flight(self, read: Callable[[], float]) -> None:
        """The in-flight gauge reads the live count at scrape time, costing nothing per request."""
        self.in_flight.set_function(read)

    def track_endpoint_in_flight(self, read: Callable[[], Iterable[tuple[str, str, int]]]) -> None:
        """``pdproxy_endpoint_in_flight{role,url}`` from ``read()``'s ``(role, url, legs)``
        at scrape time: nothing per request, and only present instances have a series."""
        self.registry.register(EndpointInFlight(read))
