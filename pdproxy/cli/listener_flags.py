"""The flags of the listener group, one ``Flag`` each: the client-facing side (address,
request and connection bounds, admission, tenants, shutdown); the others are in
``pdproxy.cli.flags``. Defaults come from the config fields they set."""

from __future__ import annotations

from pdproxy.cli import values
from pdproxy.cli.flag import LISTENER, Flag

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
