"""pdproxy's command-line flags, each declared once as a ``Flag`` (``pdproxy.cli.flag``): the
listener, fleet, upstream, observability, scale-out and tokenize-once groups here, scheduling,
resilience and security in ``flag_tables``. The parser, the ``PDPROXY_*`` environment and the
mapping onto ``ProxyConfig`` are all derived from ``FLAGS``."""

from __future__ import annotations

import argparse

from pdproxy.cli import values
from pdproxy.cli.flag import (
    FLEET,
    LISTENER,
    OBSERVABILITY,
    RENDER,
    SCALE_OUT,
    UPSTREAM,
    Flag,
    add_flags,
)
from pdproxy.cli.flag_tables import RESILIENCE_FLAGS, SCHEDULING_FLAGS, SECURITY_FLAGS
from pdproxy.config.proxy import KV_CONNECTORS, LOG_FORMATS, TRANSFER_MODES

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
_URLS = "host:port or http(s)://host:port"


def _number(group: str, names: tuple[str, ...], field: str, kind: type, text: str) -> Flag:
    return Flag(names=names, group=group, help=text, field=field, type=kind)


LISTENER_FLAGS = (
    Flag(names=("--host",), group=LISTENER, help="Address the proxy listens on.", field="host"),
    _number(LISTENER, ("--port",), "port", int, "Port the proxy listens on."),
    _number(
        LISTENER,
        ("--max-body-bytes", "--max-payload-size"),
        "max_body_bytes",
        int,
        "Largest request body accepted; larger ones get 413.",
    ),
    _number(
        LISTENER,
        ("--max-request-head-bytes",),
        "clients.max_head_bytes",
        int,
        "Largest request head (request line and headers); larger ones get 431.",
    ),
    _number(
        LISTENER,
        ("--max-request-headers",),
        "clients.max_headers",
        int,
        "Most header fields in a request (431).",
    ),
    _number(
        LISTENER,
        ("--client-header-timeout-secs",),
        "clients.header_timeout",
        float,
        "A request head must arrive whole this long after the connect or the last response.",
    ),
    _number(
        LISTENER,
        ("--client-body-timeout-secs",),
        "clients.body_timeout",
        float,
        "A request body silent this long closes its connection (408 if unanswered).",
    ),
    _number(
        LISTENER,
        ("--client-keepalive-timeout-secs",),
        "clients.keepalive_timeout",
        int,
        "Idle keep-alive connections are closed after this (uvicorn's timeout_keep_alive).",
    ),
    _number(
        LISTENER,
        ("--max-client-connections",),
        "clients.max_connections",
        int,
        "Client connections per process (0: half the open-file limit); past it the longest"
        " idle one is closed, or the new one gets 503.",
    ),
    _number(
        LISTENER,
        ("--max-concurrent-requests",),
        "admission.max_concurrent",
        int,
        "Client requests served at once (0: no limit); more wait in the queue.",
    ),
    _number(
        LISTENER,
        ("--max-queued-requests",),
        "admission.max_queued",
        int,
        "Requests that may wait for a slot; more get 429 at once.",
    ),
    _number(
        LISTENER,
        ("--queue-timeout-secs",),
        "admission.queue_timeout",
        float,
        "Longest wait for a slot before a 429.",
    ),
    _number(
        LISTENER,
        ("--shutdown-timeout-secs",),
        "shutdown_timeout",
        float,
        "On SIGTERM, how long requests in flight may finish before their streams are ended.",
    ),
)

FLEET_FLAGS = (
    Flag(
        names=("--prefill",),
        group=FLEET,
        help=f"Prefill instance(s), as {_URLS}; a port after one is its Mooncake bootstrap port.",
        field="prefill",
        nargs="+",
        action="extend",
        metavar="URL",
        convert=values.prefill_addresses,
    ),
    Flag(
        names=("--decode",),
        group=FLEET,
        help=f"Decode instance(s), as {_URLS}.",
        field="decode",
        nargs="+",
        action="extend",
        metavar="URL",
        convert=values.addresses("decode"),
    ),
    Flag(
        names=("--kv-connector",),
        group=FLEET,
        help="The engines' KV connector, which fixes how the two legs are shaped.",
        field="kv_connector",
        choices=sorted(KV_CONNECTORS),
    ),
    Flag(
        names=("--model",),
        group=FLEET,
        help="Only route to instances that serve this model.",
        field="model",
    ),
    Flag(
        names=("--transfer-mode",),
        group=FLEET,
        help="KV transfer mode all instances share (MoRIIO); by default the first one fixes it.",
        field="transfer_mode",
        type=str.upper,
        choices=TRANSFER_MODES,
    ),
    _number(
        FLEET,
        ("--registry-port",),
        "registry.port",
        int,
        "ZMQ registry port engines register with (off unless given; e.g. 30001, 36367).",
    ),
    Flag(
        names=("--registry-host",),
        group=FLEET,
        help="Address the ZMQ registry binds to.",
        field="registry.host",
    ),
    _number(
        FLEET,
        ("--registry-max-message-bytes",),
        "registry.max_message_bytes",
        int,
        "Largest registration message; a peer sending a larger one is disconnected.",
    ),
    _number(
        FLEET,
        ("--registry-ttl",),
        "registry.ttl",
        float,
        "Seconds after its last heartbeat a registered instance is forgotten.",
    ),
)

UPSTREAM_FLAGS = (
    _number(
        UPSTREAM,
        ("--connect-timeout-secs",),
        "timeouts.connect",
        float,
        "Seconds to wait for a TCP connection to an engine.",
    ),
    _number(
        UPSTREAM,
        ("--request-timeout-secs",),
        "timeouts.read",
        float,
        "Seconds an engine may stay silent (before its answer or between two chunks).",
    ),
    _number(
        UPSTREAM,
        ("--max-connections",),
        "pool.max_connections",
        int,
        "Cap on upstream connections in total (0 = no cap).",
    ),
    _number(
        UPSTREAM,
        ("--max-connections-per-host",),
        "pool.max_connections_per_host",
        int,
        "Cap on upstream connections per engine (0 = no cap).",
    ),
    _number(
        UPSTREAM,
        ("--keepalive-expiry-secs",),
        "pool.keepalive_expiry",
        float,
        "Idle pooled connections are closed after this, below vLLM's 5 s keep-alive.",
    ),
    _number(
        UPSTREAM,
        ("--max-response-body-bytes",),
        "pool.max_response_body_bytes",
        int,
        "Cap on an engine answer read whole (streams are relayed); past it the leg fails (502).",
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
    _number(
        SCALE_OUT,
        ("--workers",),
        "workers",
        int,
        "Serving processes on the one port (SO_REUSEPORT), supervised by the parent,"
        " which owns the membership (1: a single process, as without the flag).",
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
