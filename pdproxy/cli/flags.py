"""pdproxy's command-line flags, each declared once as a ``Flag`` (``pdproxy.cli.flag``): the
upstream, observability, scale-out and tokenize-once groups here, the listener's in
``listener_flags``, the fleet's in ``fleet_flags``, scheduling's in ``scheduling_flags``,
resilience and security in ``flag_tables``. The parser, the ``PDPROXY_*`` environment and the
mapping onto ``ProxyConfig`` are all derived from ``FLAGS``."""

from __future__ import annotations

import argparse

from pdproxy.cli import values
from pdproxy.cli.flag import OBSERVABILITY, RENDER, SCALE_OUT, UPSTREAM, Flag, add_flags
from pdproxy.cli.flag_tables import RESILIENCE_FLAGS, SECURITY_FLAGS
from pdproxy.cli.fleet_flags import FLEET_FLAGS
from pdproxy.cli.listener_flags import LISTENER_FLAGS
from pdproxy.cli.scheduling_flags import SCHEDULING_FLAGS
from pdproxy.config.proxy import LOG_FORMATS

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


UPSTREAM_FLAGS = (
    Flag(
        names=("--connect-timeout-secs",),
        group=UPSTREAM,
        help="Seconds to wait for a TCP connection to an engine.",
        field="timeouts.connect",
        type=float,
    ),
    Flag(
        names=("--request-timeout-secs",),
        group=UPSTREAM,
        help="Seconds an engine may stay silent (before its answer or between two chunks).",
        field="timeouts.read",
        type=float,
    ),
    Flag(
        names=("--max-connections",),
        group=UPSTREAM,
        help="Cap on upstream connections in total (0 = no cap).",
        field="pool.max_connections",
        type=int,
    ),
    Flag(
        names=("--max-connections-per-host",),
        group=UPSTREAM,
        help="Cap on upstream connections per engine (0 = no cap).",
        field="pool.max_connections_per_host",
        type=int,
    ),
    Flag(
        names=("--keepalive-expiry-secs",),
        group=UPSTREAM,
        help="Idle pooled connections are closed after this, below vLLM's 5 s keep-alive.",
        field="pool.keepalive_expiry",
        type=float,
    ),
    Flag(
        names=("--max-response-body-bytes",),
        group=UPSTREAM,
        help="Cap on an engine answer read whole (streams are relayed); past it the leg fails"
        " (502).",
        field="pool.max_response_body_bytes",
        type=int,
    ),
    Flag(
        names=("--max-stream-event-bytes",),
        group=UPSTREAM,
        help="Largest SSE event of a stream that may migrate (kept until it ends); past it the"
        " stream ends with the error event.",
        field="pool.max_stream_event_bytes",
        type=int,
    ),
    Flag(
        names=("--max-stream-bytes",),
        group=UPSTREAM,
        help="Largest relayed stream; past it the stream ends with the error event.",
        field="pool.max_stream_bytes",
        type=int,
    ),
)

OBSERVABILITY_FLAGS = (
    Flag(
        names=("--log-level",),
        group=OBSERVABILITY,
        help="Logging level.",
        field="log_level",
        choices=LOG_LEVELS,
    ),
    Flag(
        names=("--log-format",),
        group=OBSERVABILITY,
        help="Log lines as text, or as one JSON object each; both carry the request id.",
        field="log_format",
        choices=LOG_FORMATS,
    ),
    Flag(
        names=("--access-log",),
        group=OBSERVABILITY,
        help="One line per generation request on the pdproxy.access logger, at info.",
        field="access_log",
        action=argparse.BooleanOptionalAction,
    ),
    Flag(
        names=("--otlp-traces-endpoint",),
        group=OBSERVABILITY,
        help="OTLP/HTTP collector to send traces to, as vLLM's flag (needs pdproxy[otel]).",
        field="otlp_traces_endpoint",
        metavar="URL",
    ),
    Flag(
        names=("--no-dashboard",),
        group=OBSERVABILITY,
        help="Do not serve the live fleet dashboard (/dashboard and /dashboard/data).",
        field="dashboard",
        action="store_true",
        default=False,
        convert=values.dashboard,
    ),
)

SCALE_OUT_FLAGS = (
    Flag(
        names=("--workers",),
        group=SCALE_OUT,
        help="Serving processes on the one port (SO_REUSEPORT), supervised by the parent,"
        " which owns the membership (1: a single process, as without the flag).",
        field="workers",
        type=int,
    ),
    Flag(
        names=("--registry-backend",),
        group=SCALE_OUT,
        help="Where the registry lives: in-process, or etcd://host:port[,host:port...] to share"
        " it with every replica on the same etcd (pip install 'pdproxy[etcd]'; docs/scale-out.md).",
        field="registry.shared.etcd",
        default="in-process",
        metavar="BACKEND",
        convert=values.registry_backend,
    ),
    Flag(
        names=("--etcd-prefix",),
        group=SCALE_OUT,
        help="Key prefix of this fleet's shared registry in etcd (one per fleet).",
        field="registry.shared.prefix",
    ),
)

RENDER_FLAGS = (
    Flag(
        names=("--render-once",),
        group=RENDER,
        help="Render each completions/chat request once and run both legs on its token ids"
        " over /inference/v1/generate (engines need --enable-scale-out).",
        field="render_once",
        action="store_true",
    ),
    Flag(
        names=("--render",),
        group=RENDER,
        help="`vllm launch render` servers that render for --render-once (default: a decode).",
        field="render",
        nargs="+",
        action="extend",
        metavar="URL",
        convert=values.addresses("render"),
    ),
    Flag(
        names=("--first-token-from-prefill",),
        group=RENDER,
        help="Stream the token the prefill sampled as the first chunk of a token-in stream"
        " (and under --render-once) and continue the decode after it (NIXL only;"
        " docs/endpoints.md).",
        field="first_token_from_prefill",
        action="store_true",
    ),
)

FLAGS: tuple[Flag, ...] = (
    *LISTENER_FLAGS,
    *FLEET_FLAGS,
    *UPSTREAM_FLAGS,
    *SCHEDULING_FLAGS,
    *RESILIENCE_FLAGS,
    *SECURITY_FLAGS,
    *OBSERVABILITY_FLAGS,
    *SCALE_OUT_FLAGS,
    *RENDER_FLAGS,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdproxy",
        description="Prefill/decode disaggregation proxy for vLLM. Every flag can also be set "
        "as a PDPROXY_* environment variable (e.g. PDPROXY_KV_CONNECTOR=nixl).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_flags(parser, FLAGS)
    return parser
