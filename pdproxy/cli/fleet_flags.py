"""The flags of the fleet group, one ``Flag`` each: the engines pdproxy routes to, how they
are shaped (KV connector, transfer mode, push dispatch, LoRA) and the ZMQ registry they join;
the others are in ``pdproxy.cli.flags``. Defaults come from the config fields they set."""

from __future__ import annotations

from pdproxy.cli import values
from pdproxy.cli.flag import FLEET, Flag
from pdproxy.config.proxy import KV_CONNECTORS, PUSH_DISPATCH, TRANSFER_MODES

_URLS = "host:port or http(s)://host:port"

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
        names=("--push-dispatch",),
        group=FLEET,
        help="nixl-push: serial (default: P, then D; faster where engines share cores);"
        " concurrent sends both legs at once once the prefill's NIXL side is known; auto only"
        " when the decode holds part of the prompt (kv-events) (docs/push.md).",
        field="push_dispatch",
        choices=PUSH_DISPATCH,
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
