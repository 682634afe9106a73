"""pdproxy's command-line flags, grouped by concern; one help sentence each.

``cli`` turns the parsed flags (and ``PDPROXY_*`` variables) into a ``ProxyConfig``; this
module only declares them, with their defaults taken from the config classes.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from pdproxy.cli.flag_tables import (
    CLIENTS,
    HEALTH,
    LIFECYCLE,
    RETRY,
    SCHEDULING,
    UPSTREAM,
    NumberFlag,
)
from pdproxy.config.proxy import KV_CONNECTORS, LOG_FORMATS, TRANSFER_MODES
from pdproxy.config.resilience import HealthConfig
from pdproxy.config.scheduling import (
    DEFAULT_DECODE_POLICY,
    DEFAULT_PREFILL_POLICY,
    POLICIES,
    SchedulingConfig,
)

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdproxy",
        description="Prefill/decode disaggregation proxy for vLLM. Every flag can also be set "
        "as a PDPROXY_* environment variable (e.g. PDPROXY_KV_CONNECTOR=nixl).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for add_group in (
        _instance_flags,
        _scheduling_flags,
        _server_flags,
        _upstream_flags,
        _retry_flags,
        _health_flags,
        _registry_flags,
        _admin_flags,
        _security_flags,
        _lifecycle_flags,
        _render_flags,
        _worker_flags,
    ):
        add_group(p)
    return p


def _instance_flags(p: argparse.ArgumentParser) -> None:
    urls = "host:port or http(s)://host:port"
    p.add_argument(
        "--prefill",
        nargs="+",
        action="extend",
        metavar="URL",
        help=f"Prefill instance(s), as {urls}; a port after one is its Mooncake bootstrap port.",
    )
    p.add_argument(
        "--decode",
        nargs="+",
        action="extend",
        metavar="URL",
        help=f"Decode instance(s), as {urls}.",
    )
    p.add_argument(
        "--kv-connector",
        default="nixl",
        choices=sorted(KV_CONNECTORS),
        help="The engines' KV connector, which fixes how the two legs are shaped.",
    )
    p.add_argument("--model", default=None, help="Only route to instances that serve this model.")
    p.add_argument(
        "--transfer-mode",
        type=str.upper,
        choices=TRANSFER_MODES,
        default=None,
        help="KV transfer mode all instances share (MoRIIO); by default the first one fixes it.",
    )


def _scheduling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scheduling (docs/scheduling.md)")
    names = ", ".join(POLICIES)
    g.add_argument(
        "--policy",
        default=None,
        help=f"Scheduling policy for both roles: {names} (vllm-router's spellings such as "
        "round_robin and cache_aware are accepted).",
    )
    g.add_argument(
        "--prefill-policy", default=None, help=f"Prefill policy [{DEFAULT_PREFILL_POLICY}]."
    )
    g.add_argument(
        "--decode-policy", default=None, help=f"Decode policy [{DEFAULT_DECODE_POLICY}]."
    )
    g.add_argument(
        "--session-header",
        default=SchedulingConfig().session_header,
        help="Header holding the consistent-hash session key (else the body's user field).",
    )
    g.add_argument(
        "--decode-only-fallback",
        action="store_true",
        help="With no prefill routable, serve requests on a decode alone instead of a 503.",
    )
    for flags, kind, default, text in SCHEDULING:
        g.add_argument(*flags, type=kind, default=default, help=text)


def _server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="0.0.0.0", help="Address the proxy listens on.")
    p.add_argument("--port", type=int, default=8000, help="Port the proxy listens on.")
    p.add_argument(
        "--max-body-bytes",
        "--max-payload-size",
        dest="max_body_bytes",
        type=int,
        default=32 * 1024 * 1024,
        help="Largest request body accepted; larger ones get 413.",
    )
    _numbers(p, CLIENTS)
    p.add_argument(
        "--no-dashboard",
        action="store_true",
        help="Do not serve the live fleet dashboard (/dashboard and /dashboard/data).",
    )
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="Logging level.")
    p.add_argument(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="Log lines as text, or as one JSON object each; both carry the request id.",
    )
    p.add_argument(
        "--access-log",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="One line per generation request on the pdproxy.access logger, at info.",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="OTLP/HTTP collector to send traces to, as vLLM's flag (needs pdproxy[otel]).",
    )


def _numbers(p: argparse.ArgumentParser, table: Sequence[NumberFlag]) -> None:
    for flags, kind, default, text in table:
        p.add_argument(*flags, type=kind, default=default, help=text)


def _upstream_flags(p: argparse.ArgumentParser) -> None:
    _numbers(p, UPSTREAM)


def _retry_flags(p: argparse.ArgumentParser) -> None:
    _numbers(p, RETRY)


def _health_flags(p: argparse.ArgumentParser) -> None:
    _numbers(p, HEALTH)
    p.add_argument(
        "--health-check-endpoint",
        default=HealthConfig().endpoint,
        help="Path the health checks GET.",
    )


def _registry_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--registry-port",
        type=int,
        default=None,
        help="ZMQ registry port engines register with (off unless given; e.g. 30001, 36367).",
    )
    p.add_argument("--registry-host", default="0.0.0.0", help="Address the ZMQ registry binds to.")
    p.add_argument(
        "--registry-allow-cidr",
        nargs="+",
        action="extend",
        default=None,
        metavar="CIDR",
        help="Networks heartbeats are accepted from (default: any).",
    )
    p.add_argument(
        "--registry-max-message-bytes",
        type=int,
        default=64 * 1024,
        help="Largest registration message; a peer sending a larger one is disconnected.",
    )
    p.add_argument(
        "--registry-ttl",
        type=float,
        default=5.0,
        help="Seconds after its last heartbeat a registered instance is forgotten.",
    )
    p.add_argument(
        "--registry-backend",
        default="in-process",
        metavar="BACKEND",
        help="Where the registry lives: in-process, or etcd://host:port[,host:port...] to share"
        " it with every replica on the same etcd (pip install 'pdproxy[etcd]'; docs/scale-out.md).",
    )
    p.add_argument(
        "--etcd-prefix",
        default="/pdproxy/default/",
        help="Key prefix of this fleet's shared registry in etcd (one per fleet).",
    )


def _admin_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--admin-api-key-file",
        default=None,
        help="File holding the admin API key (else $ADMIN_API_KEY; with neither, admin is off).",
    )
    p.add_argument(
        "--admin-allow-cidr",
        nargs="+",
        action="extend",
        default=None,
        metavar="CIDR",
        help="Networks the admin API may add instances from (default: any).",
    )


def _security_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-key",
        nargs="+",
        action="extend",
        default=None,
        metavar="KEY",
        help="Keys clients must send as 'Authorization: Bearer KEY' (as vLLM's --api-key); "
        "prefer --api-key-file or PDPROXY_API_KEY, which stay out of ps.",
    )
    p.add_argument("--api-key-file", default=None, help="File of client keys, one per line.")
    p.add_argument(
        "--protect-metrics",
        action="store_true",
        help="/metrics and the dashboard's data (/dashboard/data) need a client key too.",
    )
    p.add_argument(
        "--engine-api-key",
        default=None,
        help="Key pdproxy sends to engines started with vLLM's --api-key (then the client's "
        "Authorization is not passed on); prefer --engine-api-key-file.",
    )
    p.add_argument("--engine-api-key-file", default=None, help="File holding --engine-api-key.")
    p.add_argument("--ssl-keyfile", default=None, help="Private key of pdproxy's HTTPS listener.")
    p.add_argument("--ssl-certfile", default=None, help="Certificate of the HTTPS listener.")
    p.add_argument("--ssl-ca-certs", default=None, help="CA that signs client certificates.")
    p.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        choices=(0, 1, 2),
        help="Client certificates: 0 none, 1 optional, 2 required (as uvicorn and vLLM).",
    )
    p.add_argument(
        "--engine-ca-certs", default=None, help="CA of https:// engines (else the system's)."
    )
    p.add_argument("--engine-client-cert", default=None, help="Client certificate for mTLS.")
    p.add_argument("--engine-client-key", default=None, help="Its private key.")


def _lifecycle_flags(p: argparse.ArgumentParser) -> None:
    _numbers(p, LIFECYCLE)


def _render_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tokenize once (docs/endpoints.md)")
    g.add_argument(
        "--render-once",
        action="store_true",
        help="Render each completions/chat request once and run both legs on its token ids"
        " over /inference/v1/generate (engines need --enable-scale-out).",
    )
    g.add_argument(
        "--render",
        nargs="+",
        action="extend",
        metavar="URL",
        help="`vllm launch render` servers that render for --render-once (default: a decode).",
    )


def _worker_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workers (docs/scale-out.md)")
    g.add_argument(
        "--workers",
        type=int,
        default=1,
        help="Serving processes on the one port (SO_REUSEPORT), supervised by the parent,"
        " which owns the membership (1: a single process, as without the flag).",
    )
