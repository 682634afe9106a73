"""The flags of the scheduling group, one ``Flag`` each (the resilience and security groups are in
``pdproxy.cli.flag_tables``, the others in ``pdproxy.cli.flags``); defaults come from the config
fields they set."""

from __future__ import annotations

from pdproxy.cli import values
from pdproxy.cli.flag import SCHEDULING, Flag
from pdproxy.config.scheduling import DEFAULT_DECODE_POLICY, DEFAULT_PREFILL_POLICY, POLICIES

_S = "scheduling."

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
        help=f"Prefill policy [{DEFAULT_PREFILL_POLICY}; kv-events with --kv-events-endpoint].",
        field=_S + "prefill_policy",
        convert=values.prefill_policy,
    ),
    Flag(
        names=("--decode-policy",),
        group=SCHEDULING,
        help=f"Decode policy [{DEFAULT_DECODE_POLICY}; kv-events with --kv-events-endpoint].",
        field=_S + "decode_policy",
        convert=values.decode_policy,
    ),
    Flag(
        names=("--model-policy",),
        group=SCHEDULING,
        help="A model's own policies, as MODEL=PREFILL[:DECODE] (the decode's defaults to the"
        " prefill's); other models keep --prefill-policy and --decode-policy.",
        field=_S + "model_policies",
        nargs="+",
        action="extend",
        default=None,
        metavar="MODEL=POLICY",
        convert=values.model_policies,
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
    Flag(
        names=("--kv-events-endpoint",),
        group=SCHEDULING,
        help="Each engine's vLLM KV-events publisher, e.g. tcp://{host}:5557 ({host}, {port}, "
        "{dp_rank}; the port is offset by the DP rank without {dp_rank}); the kv-events policy "
        "reads them.",
        field=_S + "kv_events_endpoint",
    ),
    Flag(
        names=("--kv-events-replay-endpoint",),
        group=SCHEDULING,
        help="Each engine's KV-events replay socket, e.g. tcp://{host}:5558 (same fields).",
        field=_S + "kv_events_replay_endpoint",
    ),
    Flag(
        names=("--tokenizer",),
        group=SCHEDULING,
        help="kv-events: the model's tokenizer (a directory with tokenizer.json and"
        " tokenizer_config.json, or tokenizer.json), to score text requests exactly without"
        " --render-once; MODEL=PATH for one model's own.",
        field=_S + "tokenizers",
        nargs="+",
        action="extend",
        default=None,
        metavar="[MODEL=]PATH",
        convert=values.tokenizers,
    ),
    Flag(
        names=("--kv-events-topic",),
        group=SCHEDULING,
        help="The engines' KV-events topic (vLLM's kv_events_config topic).",
        field=_S + "kv_events_topic",
    ),
    Flag(
        names=("--kv-events-max-subscribers",),
        group=SCHEDULING,
        help="Engine ranks whose KV events are followed at most (a ZMQ socket or two each);"
        " past it a rank is scored from the approximate index.",
        field=_S + "kv_events_max_subscribers",
        type=int,
    ),
    Flag(
        names=("--kv-events-stale-secs",),
        group=SCHEDULING,
        help="An engine rank sent work that publishes no KV events for this long is scored "
        "approximately until they flow again (0: never).",
        field=_S + "kv_events_stale_secs",
        type=float,
    ),
    Flag(
        names=("--kv-queue-weight",),
        group=SCHEDULING,
        help="kv-events' prefill cost: the share of an instance's queued prefill tokens a new "
        "prompt waits for (engines batch several prompts per step; 1: strictly serial).",
        field=_S + "kv_queue_weight",
        type=float,
    ),
)
