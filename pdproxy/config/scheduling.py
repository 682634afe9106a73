"""How requests are scheduled (``--policy`` and friends): a frozen, validated dataclass
and the policy name table, with vllm-router's and SMG's spellings as aliases."""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Literal

from pdproxy.errors import ConfigError

PolicyName = Literal[
    "round-robin",
    "random",
    "least-loaded",
    "power-of-two",
    "consistent-hash",
    "prefix-affinity",
    "kv-aware",
    "kv-events",
]
POLICIES: tuple[PolicyName, ...] = (
    "round-robin",
    "random",
    "least-loaded",
    "power-of-two",
    "consistent-hash",
    "prefix-affinity",
    "kv-aware",
    "kv-events",
)
# Other routers' names for the same policies, so their users switch by changing the binary.
POLICY_ALIASES: dict[str, PolicyName] = {
    "cache-aware": "prefix-affinity",  # vllm-router, SMG: cache_aware
    "prefix-hash": "prefix-affinity",  # SMG
    "consistent-hashing": "consistent-hash",  # SMG
    "least-load": "least-loaded",
    "precise-prefix-cache": "kv-events",  # llm-d's precise prefix-cache scorer
}
# Chosen by `make bench-sched` (docs/benchmarks.md): see the README's policy guide.
DEFAULT_PREFILL_POLICY: PolicyName = "prefix-affinity"
DEFAULT_DECODE_POLICY: PolicyName = "least-loaded"


def events_endpoint(value: object, name: str) -> str | None:
    """A KV events endpoint (template) as an instance or the command line gives it:
    ``tcp://`` or ``ipc://``, at most 512 characters; None stays None."""
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > 512:
        raise ConfigError(f"{name} must be a string of at most 512 characters")
    if not value.startswith(("tcp://", "ipc://")):
        raise ConfigError(f"{name} must be a tcp:// or ipc:// endpoint")
    if not template_fields_ok(value):
        raise ConfigError(
            f"{name} may name only the bare fields {{host}}, {{port}} and {{dp_rank}}"
        )
    return value


_TEMPLATE_FIELDS = frozenset(("host", "port", "dp_rank"))


def template_fields_ok(template: str) -> bool:
    """True when ``template``'s replacement fields are only bare ``{host}``, ``{port}``
    and ``{dp_rank}``: checked by parsing, never by formatting (an attribute, an index, a
    conversion or a format spec, a width of 200,000,000 among them, is refused without
    running it)."""
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError:  # an unmatched brace
        return False
    for _, field, spec, conversion in parts:
        if field is None:
            continue
        if field not in _TEMPLATE_FIELDS or spec or conversion:
            return False
    return True


def canonical_policy(name: str) -> PolicyName:
    """``name`` as one of ``POLICIES``; underscores and case are forgiven."""
    key = name.strip().lower().replace("_", "-")
    if key in POLICY_ALIASES:
        return POLICY_ALIASES[key]
    for policy in POLICIES:
        if policy == key:
            return policy
    choices = ", ".join(POLICIES)
    raise ConfigError(f"unknown scheduling policy {name!r}; choose from {choices}")


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulingConfig:
    prefill_policy: str = DEFAULT_PREFILL_POLICY
    decode_policy: str = DEFAULT_DECODE_POLICY
    session_header: str = "x-session-id"  # consistent-hash key (else the body's "user")
    pd_threshold_tokens: int = 0  # 0: every request is disaggregated
    decode_only_fallback: bool = False  # no prefill routable: serve on a decode alone
    chars_per_token: float = 4.0
    prefix_block_chars: int = 256
    prefix_index_max_blocks: int = 262_144
    cache_threshold: float = 0.3  # prefix-affinity: least share of blocks that counts
    balance_abs_threshold: float = 4.0
    balance_rel_threshold: float = 1.5
    # (model, prefill policy, decode policy): a model's own policies (--model-policy)
    model_policies: tuple[tuple[str, str, str], ...] = ()
    # where each engine rank publishes its KV events: a template of {host}, {port} (the
    # instance's) and {dp_rank}; without {dp_rank} the port is offset by the rank, as vLLM does
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    # KV-event subscribers (engine ranks followed) at most; past it a rank is scored from
    # the approximate index (each subscriber is a ZMQ socket or two)
    kv_events_max_subscribers: int = 1024
    # seconds without a batch, while sent legs that should store blocks, before an engine
    # rank's events are stale (scored approximately until they flow again); 0: never
    kv_events_stale_secs: float = 30.0
    # the share of a prefill's queued tokens a new prompt waits for in kv-events' prefill
    # cost (an engine computes several prompts per step; 1.0: strictly one after another)
    kv_queue_weight: float = 0.25
    # (model, path): the local tokenizer kv-events computes a text request's token ids with
    # (--tokenizer [MODEL=]PATH); model "" is the one for every model without its own
    tokenizers: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill_policy", canonical_policy(self.prefill_policy))
        object.__setattr__(self, "decode_policy", canonical_policy(self.decode_policy))
        object.__setattr__(
            self,
            "model_policies",
            tuple((m, canonical_policy(p), canonical_policy(d)) for m, p, d in self.model_policies),
        )
        object.__setattr__(self, "session_header", self.session_header.strip().lower())
        if not self.session_header:
            raise ConfigError("--session-header must not be empty")
        if self.pd_threshold_tokens < 0:
            raise ConfigError("--pd-threshold-tokens must be >= 0")
        if self.chars_per_token <= 0:
            raise ConfigError("--chars-per-token must be positive")
        if self.prefix_block_chars < 1 or self.prefix_index_max_blocks < 1:
            raise ConfigError("--prefix-block-chars and --prefix-index-max-blocks must be >= 1")
        if not 0 <= self.cache_threshold <= 1:
            raise ConfigError("--cache-threshold must be in [0, 1]")
        if self.kv_events_max_subscribers < 1:
            raise ConfigError("--kv-events-max-subscribers must be >= 1")
        events_endpoint(self.kv_events_endpoint, "--kv-events-endpoint")
        events_endpoint(self.kv_events_replay_endpoint, "--kv-events-replay-endpoint")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ConfigError("--kv-events-replay-endpoint needs --kv-events-endpoint")
        if self.kv_events_stale_secs < 0:
            raise ConfigError("--kv-events-stale-secs must be >= 0")
        if not 0 <= self.kv_queue_weight <= 1:
            raise ConfigError("--kv-queue-weight must be in [0, 1]")
        models = [model for model, _ in self.tokenizers]
        if len(set(models)) < len(models):
            raise ConfigError("--tokenizer: one tokenizer per model (and one without MODEL=)")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1:
            raise ConfigError(
                "--balance-abs-threshold must be >= 0 and --balance-rel-threshold >= 1"
            )


def parse_model_policies(specs: tuple[str, ...]) -> tuple[tuple[str, str, str], ...]:
    """``MODEL=PREFILL[:DECODE]`` each (the decode's policy defaults to the prefill's);
    raises ``ConfigError``."""
    parsed = []
    for spec in specs:
        model, sep, policies = spec.partition("=")
        prefill, _, decode = policies.partition(":")
        if not sep or not model.strip() or not prefill.strip():
            raise ConfigError(f"--model-policy: {spec!r} is not MODEL=PREFILL[:DECODE]")
        parsed.append((model.strip(), prefill, decode or prefill))
    return tuple(parsed)


def parse_tokenizers(specs: tuple[str, ...]) -> tuple[tuple[str, str], ...]:
    """``PATH`` (every model's) or ``MODEL=PATH`` each; a spec whose text before the first
    ``=`` holds a ``/`` is a path; raises ``ConfigError``."""
    parsed = []
    for spec in specs:
        model, sep, path = spec.partition("=")
        if not sep or "/" in model:  # a path (which may hold a "=" past a "/")
            model, path = "", spec
        elif not model.strip():
            raise ConfigError(f"--tokenizer: {spec!r} names no model before its '='")
        if not path.strip():
            raise ConfigError(f"--tokenizer: {spec!r} is not PATH or MODEL=PATH")
        parsed.append((model.strip(), path.strip()))
    return tuple(parsed)
