"""The flags of the scheduling, resilience and security groups, one ``Flag`` each (the others are
in ``pdproxy.cli.flags``); defaults come from the config fields they set."""

from __future__ import annotations

from pdproxy.cli import values
from pdproxy.cli.flag import RESILIENCE, SCHEDULING, SECURITY, Flag
from pdproxy.config.listener import CERT_REQS
from pdproxy.config.resilience import RetryConfig
from pdproxy.config.scheduling import DEFAULT_DECODE_POLICY, DEFAULT_PREFILL_POLICY, POLICIES

_S, _R = "scheduling.", RetryConfig()

SCHEDULING_FLAGS = (
    Flag(
        names=("--policy",),
        group=SCHEDULING,
        help=f"Scheduling policy for both roles: {', '.join(POLICIES)} (vllm-router's spellings"
        " such as round_robin and cache_aware are accepted).",
        field=None,  # read by the two below
        default=None,
    ),
    Flag(
        names=("--prefill-policy",),
        group=SCHEDULING,
        help=f"Prefill policy [{DEFAULT_PREFILL_POLICY}].",
        field=_S + "prefill_policy",
        convert=values.prefill_policy,
    ),
    Flag(
        names=("--decode-policy",),
        group=SCHEDULING,
        help=f"Decode policy [{DEFAULT_DECODE_POLICY}].",
        field=_S + "decode_policy",
        convert=values.decode_policy,
    ),
    Flag(
        names=("--session-header",),
        group=SCHEDULING,
        help="Header holding the consistent-hash session key (else the body's user field).",
        field=_S + "session_header",
    ),
    Flag(
        names=("--decode-only-fallback",),
        group=SCHEDULING,
        help="With no prefill routable, serve requests on a decode alone instead of a 503.",
        field=_S + "decode_only_fallback",
        action="store_true",
    ),
    Flag(
        names=("--pd-threshold-tokens",),
        group=SCHEDULING,
        help="Prompts estimated under this many uncached tokens skip the prefill (0: never).",
        field=_S + "pd_threshold_tokens",
        type=int,
    ),
    Flag(
        names=("--chars-per-token",),
        group=SCHEDULING,
        help="Characters per token, for estimates.",
        field=_S + "chars_per_token",
        type=float,
    ),
    Flag(
        names=("--prefix-block-chars",),
        group=SCHEDULING,
        help="Characters per block of the prefix index.",
        field=_S + "prefix_block_chars",
        type=int,
    ),
    Flag(
        names=("--prefix-index-max-blocks",),
        group=SCHEDULING,
        help="Blocks the prefix index keeps per role (LRU; about 100 bytes each).",
        field=_S + "prefix_index_max_blocks",
        type=int,
    ),
    Flag(
        names=("--cache-threshold",),
        group=SCHEDULING,
        help="prefix-affinity ignores matches under this share of the prompt (SMG's name).",
        field=_S + "cache_threshold",
        type=float,
    ),
    Flag(
        names=("--balance-abs-threshold",),
        group=SCHEDULING,
        help="prefix-affinity skips instances this many requests busier than the least busy...",
        field=_S + "balance_abs_threshold",
        type=float,
    ),
    Flag(
        names=("--balance-rel-threshold",),
        group=SCHEDULING,
        help="...and this many times as busy.",
        field=_S + "balance_rel_threshold",
        type=float,
    ),
)


def _resilience(names: tuple[str, ...], field: str, kind: type, text: str) -> Flag:
    return Flag(names=names, group=RESILIENCE, help=text, field=field, type=kind)


RESILIENCE_FLAGS = (
    _resilience(
        ("--max-retries", "--retry-max-retries"),
        "retry.max_retries",
        int,
        "Retries of a failed leg on another instance before the response starts (0: none).",
    ),
    _resilience(
        ("--prefill-timeout-secs",),
        "timeouts.prefill",
        float,
        "Seconds a prefill leg may take in all before it is retried elsewhere.",
    ),
    _resilience(
        ("--decode-header-timeout-secs",),
        "timeouts.decode_headers",
        float,
        "Seconds to wait for a streaming decode's response headers before retrying elsewhere.",
    ),
    _resilience(
        ("--retry-budget-ratio",),
        "retry.budget_ratio",
        float,
        "Retries allowed as a share of the requests of the last 10 s, fleet-wide.",
    ),
    _resilience(
        ("--retry-budget-min-per-sec",),
        "retry.budget_min_per_sec",
        float,
        "Retries per second always allowed on top of the ratio.",
    ),
    Flag(
        names=("--retry-initial-backoff-ms",),
        group=RESILIENCE,
        help="Backoff before retrying once every instance of a role was tried.",
        field="retry.initial_backoff",
        type=float,
        default=_R.initial_backoff * 1000,
        convert=values.seconds("retry_initial_backoff_ms"),
    ),
    Flag(
        names=("--retry-max-backoff-ms",),
        group=RESILIENCE,
        help="Longest such backoff.",
        field="retry.max_backoff",
        type=float,
        default=_R.max_backoff * 1000,
        convert=values.seconds("retry_max_backoff_ms"),
    ),
    _resilience(
        ("--health-check-interval-secs",),
        "health.interval",
        float,
        "Seconds between active health checks of every instance (0: off).",
    ),
    _resilience(
        ("--health-check-timeout-secs",), "health.timeout", float, "Timeout of one health check."
    ),
    _resilience(
        ("--engine-metrics-interval-secs",),
        "health.engine_metrics_interval",
        float,
        "Seconds between scrapes of every instance's /metrics for its load (0: off).",
    ),
    _resilience(
        ("--health-failure-threshold",),
        "health.failure_threshold",
        int,
        "Failed checks in a row that make an instance unhealthy (not routable).",
    ),
    _resilience(
        ("--health-success-threshold",),
        "health.success_threshold",
        int,
        "Passed checks in a row that make an unhealthy instance healthy again.",
    ),
    Flag(
        names=("--health-check-endpoint",),
        group=RESILIENCE,
        help="Path the health checks GET.",
        field="health.endpoint",
    ),
    _resilience(
        ("--warm-pairs",),
        "health.warm_pairs",
        int,
        "Peers of the other role a new instance warms a P/D pair with (one tiny PD request"
        " each, the connector's handshake) before it is routable (0: off).",
    ),
    _resilience(
        ("--warm-timeout-secs",),
        "health.warm_timeout",
        float,
        "Longest a new instance waits for its warm-up before it is routable anyway.",
    ),
    _resilience(
        ("--outlier-consecutive-failures", "--cb-failure-threshold"),
        "outlier.consecutive_failures",
        int,
        "Failed legs in a row that eject an instance from rotation (0: never eject).",
    ),
    _resilience(
        ("--outlier-base-ejection-secs", "--cb-timeout-duration-secs"),
        "outlier.base_ejection",
        float,
        "First ejection's length; it doubles on each re-ejection.",
    ),
    _resilience(
        ("--outlier-max-ejection-secs",), "outlier.max_ejection", float, "Longest ejection."
    ),
    _resilience(
        ("--overload-cooldown-secs",),
        "outlier.overload_cooldown",
        float,
        "After an engine answers 429 or 408, send new requests to its peers first this long.",
    ),
    _resilience(
        ("--max-ejection-percent",),
        "outlier.max_ejection_percent",
        float,
        "Most of a role's instances ejected at once, in percent (never the last one).",
    ),
)


def _secret(names: tuple[str, ...], field: str | None, text: str) -> Flag:
    """A path or key given as is (a file's content is read by its partner's ``convert``)."""
    return Flag(names=names, group=SECURITY, help=text, field=field, default=None)


SECURITY_FLAGS = (
    Flag(
        names=("--api-key",),
        group=SECURITY,
        help="Keys clients must send as 'Authorization: Bearer KEY' (as vLLM's --api-key); "
        "prefer --api-key-file or PDPROXY_API_KEY, which stay out of ps.",
        field="api_keys",
        nargs="+",
        action="extend",
        metavar="KEY",
        convert=values.client_keys,
    ),
    _secret(("--api-key-file",), None, "File of client keys, one per line."),
    Flag(
        names=("--protect-metrics",),
        group=SECURITY,
        help="/metrics and the dashboard's data (/dashboard/data) need a client key too.",
        field="protect_metrics",
        action="store_true",
    ),
    Flag(
        names=("--admin-api-key-file",),
        group=SECURITY,
        help="File holding the admin API key (else $ADMIN_API_KEY; with neither, admin is off).",
        field="admin_api_key",
        convert=values.admin_key,
    ),
    Flag(  # no flag, so that the key stays out of ps; ADMIN_API_KEY is its older name
        names=(),
        dest="admin_api_key",
        group=SECURITY,
        help="The admin API key (PDPROXY_ADMIN_API_KEY, else ADMIN_API_KEY).",
        field=None,  # read by --admin-api-key-file's convert, which wins
        env_aliases=("ADMIN_API_KEY",),
    ),
    Flag(
        names=("--admin-allow-cidr",),
        group=SECURITY,
        help="Networks the admin API may add instances from (default: any).",
        field="admin_allow_cidrs",
        nargs="+",
        action="extend",
        default=None,
        metavar="CIDR",
    ),
    Flag(
        names=("--registry-allow-cidr",),
        group=SECURITY,
        help="Networks heartbeats are accepted from (default: any).",
        field="registry.allow_cidrs",
        nargs="+",
        action="extend",
        default=None,
        metavar="CIDR",
    ),
    Flag(
        names=("--engine-api-key",),
        group=SECURITY,
        help="Key pdproxy sends to engines started with vLLM's --api-key (then the client's "
        "Authorization is not passed on); prefer --engine-api-key-file.",
        field="engine_api_key",
        convert=values.engine_key,
    ),
    _secret(("--engine-api-key-file",), None, "File holding --engine-api-key."),
    _secret(("--ssl-keyfile",), "tls.keyfile", "Private key of pdproxy's HTTPS listener."),
    _secret(("--ssl-certfile",), "tls.certfile", "Certificate of the HTTPS listener."),
    _secret(("--ssl-ca-certs",), "tls.ca_certs", "CA that signs client certificates."),
    Flag(
        names=("--ssl-cert-reqs",),
        group=SECURITY,
        help="Client certificates: 0 none, 1 optional, 2 required (as uvicorn and vLLM).",
        field="tls.cert_reqs",
        type=int,
        choices=CERT_REQS,
    ),
    _secret(
        ("--engine-ca-certs",), "engine_tls.ca_certs", "CA of https:// engines (else the system's)."
    ),
    _secret(("--engine-client-cert",), "engine_tls.certfile", "Client certificate for mTLS."),
    _secret(("--engine-client-key",), "engine_tls.keyfile", "Its private key."),
)
