"""pdproxy's numeric command-line flags as tables: (flags, type, default, help), one line
each, the defaults taken from the config classes (``pdproxy.cli.flags`` adds them by group)."""

from __future__ import annotations

from pdproxy.config.listener import AdmissionConfig, ClientLimits
from pdproxy.config.resilience import HealthConfig, OutlierConfig, RetryConfig
from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.config.upstream import PoolLimits, Timeouts

# Numeric flags, as (flags, type, default, help): one line each, defaults from the config.
_T, _R, _H, _O, _A = Timeouts(), RetryConfig(), HealthConfig(), OutlierConfig(), AdmissionConfig()
NumberFlag = tuple[tuple[str, ...], type, float, str]
_S = SchedulingConfig()
_C = ClientLimits()

SCHEDULING: tuple[NumberFlag, ...] = (
    (
        ("--pd-threshold-tokens",),
        int,
        _S.pd_threshold_tokens,
        "Prompts estimated under this many uncached tokens skip the prefill (0: never).",
    ),
    (("--chars-per-token",), float, _S.chars_per_token, "Characters per token, for estimates."),
    (
        ("--prefix-block-chars",),
        int,
        _S.prefix_block_chars,
        "Characters per block of the prefix index.",
    ),
    (
        ("--prefix-index-max-blocks",),
        int,
        _S.prefix_index_max_blocks,
        "Blocks the prefix index keeps per role (LRU; about 100 bytes each).",
    ),
    (
        ("--cache-threshold",),
        float,
        _S.cache_threshold,
        "prefix-affinity ignores matches under this share of the prompt (SMG's name).",
    ),
    (
        ("--balance-abs-threshold",),
        float,
        _S.balance_abs_threshold,
        "prefix-affinity skips instances this many requests busier than the least busy...",
    ),
    (
        ("--balance-rel-threshold",),
        float,
        _S.balance_rel_threshold,
        "...and this many times as busy.",
    ),
)

CLIENTS: tuple[NumberFlag, ...] = (
    (
        ("--max-request-head-bytes",),
        int,
        _C.max_head_bytes,
        "Largest request head (request line and headers); larger ones get 431.",
    ),
    (("--max-request-headers",), int, _C.max_headers, "Most header fields in a request (431)."),
    (
        ("--client-header-timeout-secs",),
        float,
        _C.header_timeout,
        "A request head must arrive whole this long after the connect or the last response.",
    ),
    (
        ("--client-body-timeout-secs",),
        float,
        _C.body_timeout,
        "A request body silent this long closes its connection (408 if unanswered).",
    ),
    (
        ("--client-keepalive-timeout-secs",),
        int,
        _C.keepalive_timeout,
        "Idle keep-alive connections are closed after this (uvicorn's timeout_keep_alive).",
    ),
    (
        ("--max-client-connections",),
        int,
        _C.max_connections,
        "Client connections per process (0: half the open-file limit); past it the longest"
        " idle one is closed, or the new one gets 503.",
    ),
)
UPSTREAM: tuple[NumberFlag, ...] = (
    (
        ("--connect-timeout-secs",),
        float,
        _T.connect,
        "Seconds to wait for a TCP connection to an engine.",
    ),
    (
        ("--request-timeout-secs",),
        float,
        _T.read,
        "Seconds an engine may stay silent (before its answer or between two chunks).",
    ),
    (("--max-connections",), int, 0, "Cap on upstream connections in total (0 = no cap)."),
    (
        ("--max-connections-per-host",),
        int,
        0,
        "Cap on upstream connections per engine (0 = no cap).",
    ),
    (
        ("--keepalive-expiry-secs",),
        float,
        4.0,
        "Idle pooled connections are closed after this, below vLLM's 5 s keep-alive.",
    ),
    (
        ("--max-response-body-bytes",),
        int,
        PoolLimits().max_response_body_bytes,
        "Cap on an engine answer read whole (streams are relayed); past it the leg fails (502).",
    ),
)
RETRY: tuple[NumberFlag, ...] = (
    (
        ("--max-retries", "--retry-max-retries"),
        int,
        _R.max_retries,
        "Retries of a failed leg on another instance before the response starts (0: none).",
    ),
    (
        ("--prefill-timeout-secs",),
        float,
        _T.prefill,
        "Seconds a prefill leg may take in all before it is retried elsewhere.",
    ),
    (
        ("--decode-header-timeout-secs",),
        float,
        _T.decode_headers,
        "Seconds to wait for a streaming decode's response headers before retrying elsewhere.",
    ),
    (
        ("--retry-budget-ratio",),
        float,
        _R.budget_ratio,
        "Retries allowed as a share of the requests of the last 10 s, fleet-wide.",
    ),
    (
        ("--retry-budget-min-per-sec",),
        float,
        _R.budget_min_per_sec,
        "Retries per second always allowed on top of the ratio.",
    ),
    (
        ("--retry-initial-backoff-ms",),
        float,
        _R.initial_backoff * 1000,
        "Backoff before retrying once every instance of a role was tried.",
    ),
    (("--retry-max-backoff-ms",), float, _R.max_backoff * 1000, "Longest such backoff."),
)
HEALTH: tuple[NumberFlag, ...] = (
    (
        ("--health-check-interval-secs",),
        float,
        _H.interval,
        "Seconds between active health checks of every instance (0: off).",
    ),
    (("--health-check-timeout-secs",), float, _H.timeout, "Timeout of one health check."),
    (
        ("--engine-metrics-interval-secs",),
        float,
        _H.engine_metrics_interval,
        "Seconds between scrapes of every instance's /metrics for its load (0: off).",
    ),
    (
        ("--health-failure-threshold",),
        int,
        _H.failure_threshold,
        "Failed checks in a row that make an instance unhealthy (not routable).",
    ),
    (
        ("--health-success-threshold",),
        int,
        _H.success_threshold,
        "Passed checks in a row that make an unhealthy instance healthy again.",
    ),
    (
        ("--warm-pairs",),
        int,
        _H.warm_pairs,
        "Peers of the other role a new instance warms a P/D pair with (one tiny PD request"
        " each, the connector's handshake) before it is routable (0: off).",
    ),
    (
        ("--warm-timeout-secs",),
        float,
        _H.warm_timeout,
        "Longest a new instance waits for its warm-up before it is routable anyway.",
    ),
    (
        ("--outlier-consecutive-failures", "--cb-failure-threshold"),
        int,
        _O.consecutive_failures,
        "Failed legs in a row that eject an instance from rotation (0: never eject).",
    ),
    (
        ("--outlier-base-ejection-secs", "--cb-timeout-duration-secs"),
        float,
        _O.base_ejection,
        "First ejection's length; it doubles on each re-ejection.",
    ),
    (("--outlier-max-ejection-secs",), float, _O.max_ejection, "Longest ejection."),
    (
        ("--overload-cooldown-secs",),
        float,
        _O.overload_cooldown,
        "After an engine answers 429 or 408, send new requests to its peers first this long.",
    ),
    (
        ("--max-ejection-percent",),
        float,
        _O.max_ejection_percent,
        "Most of a role's instances ejected at once, in percent (never the last one).",
    ),
)
LIFECYCLE: tuple[NumberFlag, ...] = (
    (
        ("--max-concurrent-requests",),
        int,
        _A.max_concurrent,
        "Client requests served at once (0: no limit); more wait in the queue.",
    ),
    (
        ("--max-queued-requests",),
        int,
        _A.max_queued,
        "Requests that may wait for a slot; more get 429 at once.",
    ),
    (("--queue-timeout-secs",), float, _A.queue_timeout, "Longest wait for a slot before a 429."),
    (
        ("--shutdown-timeout-secs",),
        float,
        30.0,
        "On SIGTERM, how long requests in flight may finish before their streams are ended.",
    ),
)
