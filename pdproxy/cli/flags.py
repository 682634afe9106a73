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
from pdproxy.cli.flag_tables import RESILIENCE_FLAGS, SECURITY_FLAGS
from pdproxy.cli.scheduling_flags import SCHEDULING_FLAGS
from pdproxy.config.proxy import KV_CONNECTORS, LOG_FORMATS, TRANSFER_MODES

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
_URLS = "host:port or http(s)://host:port"


LISTENER_FLAGS = (
    Flag(names=("--host",), group=LISTENER, help="Address the proxy listens on.", field="host"),
    Flag(
        names=("--port",), group=LISTENER, help="Port the proxy listens on.", field="port", type=int
    ),
    Flag(
        names=("--max-body-bytes", "--max-payload-size"),
        group=LISTENER,
        help="Largest request body accepted; larger ones get 413.",
        field="max_body_bytes",
        type=int,
    ),
    Flag(
        names=("--max-request-head-bytes",),
        group=LISTENER,
        help="Largest request head (request line and headers); larger ones get 431.",
        field="clients.max_head_bytes",
        type=int,
    ),
    Flag(
        names=("--max-request-headers",),
        group=LISTENER,
        help="Most header fields in a request (431).",
        field="clients.max_headers",
        type=int,
    ),
    Flag(
        names=("--client-header-timeout-secs",),
        group=LISTENER,
        help="A request head must arrive whole this long after the connect or the last response.",
        field="clients.header_timeout",
        type=float,
    ),
    Flag(
        names=("--client-body-timeout-secs",),
        group=LISTENER,
        help="A request body silent this long closes its connection (408 if unanswered).",
        field="clients.body_timeout",
        type=float,
    ),
    Flag(
        names=("--client-keepalive-timeout-secs",),
        group=LISTENER,
        help="Idle keep-alive connections are closed after this (uvicorn's timeout_keep_alive).",
        field="clients.keepalive_timeout",
        type=int,
    ),
    Flag(
        names=("--max-client-connections",),
        group=LISTENER,
        help="Client connections per process (0: half the open-file limit); past it the longest"
        " idle one is closed, or the new one gets 503.",
        field="clients.max_connections",
        type=int,
    ),
    Flag(
        names=("--max-concurrent-requests",),
        group=LISTENER,
        help="Client requests served at once (0: no limit); more wait in the queue.",
        field="admission.max_concurrent",
        type=int,
    ),
    Flag(
        names=("--max-queued-requests",),
        group=LISTENER,
        help="Requests that may wait for a slot; more get 429 at once.",
        field="admission.max_queued",
        type=int,
    ),
    Flag(
        names=("--queue-timeout-secs",),
        group=LISTENER,
        help="Longest wait for a slot before a 429.",
        field="admission.queue_timeout",
        type=float,
    ),
    Flag(
        names=("--tenants",),
        group=LISTENER,
        help="Tenants file (JSON or YAML): each tenant's weight, default priority,"
        " max_concurrent and tokens/requests per minute (docs/flow-control.md); reloaded on"
        " SIGHUP.",
        field="tenants",
        default=None,
        metavar="FILE",
        convert=values.tenants,
    ),
    Flag(
        names=("--prefill-capacity",),
        group=LISTENER,
        help="Requests one prefill instance runs at once; past it, prefill legs wait in"
        " pdproxy in flow-control order (default under --tenants: learned from each engine's"
        " /metrics; 0: never wait).",
        field="admission.prefill_capacity",
        type=int,
        default=None,
        metavar="N",
    ),
    Flag(
        names=("--decode-capacity",),
        group=LISTENER,
        help="Requests one decode instance runs at once; past it, decode legs wait in"
        " pdproxy in flow-control order (default under --tenants: learned; 0: never wait).",
        field="admission.decode_capacity",
        type=int,
        default=None,
        metavar="N",
    ),
    Flag(
        names=("--tenant-header",),
        group=LISTENER,
        help="Header naming a request's tenant when client keys do not (e.g. X-Tenant).",
        field=None,
        default=None,
        metavar="NAME",
    ),
    Flag(
        names=("--shutdown-timeout-secs",),
        group=LISTENER,
        help="On SIGTERM, how long requests in flight may finish before their streams are ended.",
        field="shutdown_timeout",
        type=float,
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
        names=("--lora-modules",),
        group=FLEET,
        help="LoRA adapters pdproxy may load on the engines, as NAME=PATH (vLLM's spelling).",
        field="lora.modules",
        nargs="+",
        action="extend",
        default=None,
        metavar="NAME=PATH",
        convert=values.lora_modules,
    ),
    Flag(
        names=("--lora-path-root",),
        group=FLEET,
        help="Directories the admin's /v1/load_lora_adapter may load from (besides"
        " --lora-modules' paths); default: any path.",
        field="lora.path_roots",
        nargs="+",
        action="extend",
        default=None,
        metavar="DIR",
    ),
    Flag(
        names=("--lora-load-on-demand",),
        group=FLEET,
        help="A request for a --lora-modules adapter no routable pair holds loads it on the"
        " chosen prefill and decode first (VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 engines).",
        field="lora.load_on_demand",
        action="store_true",
    ),
    Flag(
        names=("--max-loras",),
        group=FLEET,
        help="Adapters pdproxy keeps loaded per instance; the least recently used one is"
        " unloaded to make room (0: no limit).",
        field="lora.max_loras",
        type=int,
    ),
    Flag(
        names=("--transfer-mode",),
        group=FLEET,
        help="KV transfer mode all instances share (MoRIIO); by default the first one fixes it.",
        field="transfer_mode",
        type=str.upper,
        choices=TRANSFER_MODES,
    ),
    Flag(
        names=("--registry-port",),
        group=FLEET,
        help="ZMQ registry port engines register with (off unless given; e.g. 30001, 36367).",
        field="registry.port",
        type=int,
    ),
    Flag(
        names=("--registry-host",),
        group=FLEET,
        help="Address the ZMQ registry binds to.",
        field="registry.host",
    ),
    Flag(
        names=("--registry-max-message-bytes",),
        group=FLEET,
        help="Largest registration message; a peer sending a larger one is disconnected.",
        field="registry.max_message_bytes",
        type=int,
    ),
    Flag(
        names=("--registry-max-dp-size",),
        group=FLEET,
        help="Largest dp_size a registration may state (each DP rank gets a KV-event"
        " subscriber); past it the message is malformed.",
        field="registry.max_dp_size",
        type=int,
    ),
    Flag(
        names=("--registry-max-tp-size",),
        group=FLEET,
        help="Largest tp_size a registration may state; past it the message is malformed.",
        field="registry.max_tp_size",
        type=int,
    ),
    Flag(
        names=("--registry-kv-events-host",),
        group=FLEET,
        help="Hosts a registration's own KV events endpoint may name besides the instance's"
        " own (default: only its own; never an ipc:// path).",
        field="registry.kv_events_hosts",
        nargs="+",
        action="extend",
        default=None,
        metavar="HOST",
    ),
    Flag(
        names=("--registry-ttl",),
        group=FLEET,
        help="Seconds after its last heartbeat a registered instance is forgotten.",
        field="registry.ttl",
        type=float,
    ),
)

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
