"""The flags of the resilience and security groups, one ``Flag`` each (scheduling's are in
``pdproxy.cli.scheduling_flags``, the others in ``pdproxy.cli.flags``); defaults come from the
config fields they set."""

from __future__ import annotations

from pdproxy.cli import values
from pdproxy.cli.flag import RESILIENCE, SECURITY, Flag
from pdproxy.config.listener import CERT_REQS
from pdproxy.config.resilience import RetryConfig

_S, _R = "scheduling.", RetryConfig()

RESILIENCE_FLAGS = (
    Flag(
        names=("--max-retries", "--retry-max-retries"),
        group=RESILIENCE,
        help="Retries of a failed leg on another instance before the response starts (0: none).",
        field="retry.max_retries",
        type=int,
    ),
    Flag(
        names=("--migration-limit",),
        group=RESILIENCE,
        help="Times a stream cut mid-answer may continue on another decode (0: never).",
        field="retry.migration_limit",
        type=int,
    ),
    Flag(
        names=("--prefill-timeout-secs",),
        group=RESILIENCE,
        help="Seconds a prefill leg may take in all before it is retried elsewhere.",
        field="timeouts.prefill",
        type=float,
    ),
    Flag(
        names=("--decode-header-timeout-secs",),
        group=RESILIENCE,
        help="Seconds to wait for a streaming decode's response headers before retrying elsewhere.",
        field="timeouts.decode_headers",
        type=float,
    ),
    Flag(
        names=("--push-wait-secs",),
        group=RESILIENCE,
        help="nixl-push: seconds a concurrent decode may wait for its KV once its prefill"
        " answered; past it the decode is taken out until its KV is freed, and the request"
        " retried.",
        field="timeouts.push_wait",
        type=float,
    ),
    Flag(
        names=("--retry-budget-ratio",),
        group=RESILIENCE,
        help="Retries allowed as a share of the requests of the last 10 s, fleet-wide.",
        field="retry.budget_ratio",
        type=float,
    ),
    Flag(
        names=("--retry-budget-min-per-sec",),
        group=RESILIENCE,
        help="Retries per second always allowed on top of the ratio.",
        field="retry.budget_min_per_sec",
        type=float,
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
    Flag(
        names=("--health-check-interval-secs",),
        group=RESILIENCE,
        help="Seconds between active health checks of every instance (0: off).",
        field="health.interval",
        type=float,
    ),
    Flag(
        names=("--health-check-timeout-secs",),
        group=RESILIENCE,
        help="Timeout of one health check.",
        field="health.timeout",
        type=float,
    ),
    Flag(
        names=("--engine-metrics-interval-secs",),
        group=RESILIENCE,
        help="Seconds between scrapes of every instance's /metrics for its load (0: off).",
        field="health.engine_metrics_interval",
        type=float,
    ),
    Flag(
        names=("--models-refresh-secs",),
        group=RESILIENCE,
        help="Seconds between re-reads of every instance's /v1/models: the models and LoRA"
        " adapters it serves, which decide the requests it takes (0: off).",
        field="health.models_interval",
        type=float,
    ),
    Flag(
        names=("--max-models-per-instance",),
        group=RESILIENCE,
        help="Models (and adapters) one instance may list in /v1/models; an instance listing"
        " more is not admitted (and a re-read listing more is ignored).",
        field="health.max_models",
        type=int,
    ),
    Flag(
        names=("--health-failure-threshold",),
        group=RESILIENCE,
        help="Failed checks in a row that make an instance unhealthy (not routable).",
        field="health.failure_threshold",
        type=int,
    ),
    Flag(
        names=("--health-success-threshold",),
        group=RESILIENCE,
        help="Passed checks in a row that make an unhealthy instance healthy again.",
        field="health.success_threshold",
        type=int,
    ),
    Flag(
        names=("--health-check-endpoint",),
        group=RESILIENCE,
        help="Path the health checks GET.",
        field="health.endpoint",
    ),
    Flag(
        names=("--warm-pairs",),
        group=RESILIENCE,
        help="Peers of the other role a new instance warms a P/D pair with (one tiny PD request"
        " each, the connector's handshake) before it is routable (0: off).",
        field="health.warm_pairs",
        type=int,
    ),
    Flag(
        names=("--warm-timeout-secs",),
        group=RESILIENCE,
        help="Longest a new instance waits for its warm-up before it is routable anyway.",
        field="health.warm_timeout",
        type=float,
    ),
    Flag(
        names=("--outlier-consecutive-failures", "--cb-failure-threshold"),
        group=RESILIENCE,
        help="Failed legs in a row that eject an instance from rotation (0: never eject).",
        field="outlier.consecutive_failures",
        type=int,
    ),
    Flag(
        names=("--outlier-base-ejection-secs", "--cb-timeout-duration-secs"),
        group=RESILIENCE,
        help="First ejection's length; it doubles on each re-ejection.",
        field="outlier.base_ejection",
        type=float,
    ),
    Flag(
        names=("--outlier-max-ejection-secs",),
        group=RESILIENCE,
        help="Longest ejection.",
        field="outlier.max_ejection",
        type=float,
    ),
    Flag(
        names=("--overload-cooldown-secs",),
        group=RESILIENCE,
        help="After an engine answers 429 or 408, send new requests to its peers first this long.",
        field="outlier.overload_cooldown",
        type=float,
    ),
    Flag(
        names=("--max-ejection-percent",),
        group=RESILIENCE,
        help="Most of a role's instances ejected at once, in percent (never the last one).",
        field="outlier.max_ejection_percent",
        type=float,
    ),
)


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
    Flag(
        names=("--api-key-file",),
        group=SECURITY,
        help="File of client keys, one per line (a line may name its tenant: 'KEY tenant=NAME').",
        field=None,
        default=None,
    ),
    Flag(  # no flag of its own: the tenants that --api-key-file's lines name
        names=(),
        dest="key_tenants",
        group=SECURITY,
        help="Each client key's tenant, from --api-key-file.",
        field="key_tenants",
        convert=values.key_tenants,
    ),
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
    Flag(
        names=("--engine-api-key-file",),
        group=SECURITY,
        help="File holding --engine-api-key.",
        field=None,
        default=None,
    ),
    Flag(
        names=("--ssl-keyfile",),
        group=SECURITY,
        help="Private key of pdproxy's HTTPS listener.",
        field="tls.keyfile",
        default=None,
    ),
    Flag(
        names=("--ssl-certfile",),
        group=SECURITY,
        help="Certificate of the HTTPS listener.",
        field="tls.certfile",
        default=None,
    ),
    Flag(
        names=("--ssl-ca-certs",),
        group=SECURITY,
        help="CA that signs client certificates.",
        field="tls.ca_certs",
        default=None,
    ),
    Flag(
        names=("--ssl-cert-reqs",),
        group=SECURITY,
        help="Client certificates: 0 none, 1 optional, 2 required (as uvicorn and vLLM).",
        field="tls.cert_reqs",
        type=int,
        choices=CERT_REQS,
    ),
    Flag(
        names=("--engine-ca-certs",),
        group=SECURITY,
        help="CA of https:// engines (else the system's).",
        field="engine_tls.ca_certs",
        default=None,
    ),
    Flag(
        names=("--engine-client-cert",),
        group=SECURITY,
        help="Client certificate for mTLS.",
        field="engine_tls.certfile",
        default=None,
    ),
    Flag(
        names=("--engine-client-key",),
        group=SECURITY,
        help="Its private key.",
        field="engine_tls.keyfile",
        default=None,
    ),
)
