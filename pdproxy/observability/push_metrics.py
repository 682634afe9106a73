"""The metrics of NIXL push transfers (``--kv-connector nixl-push``, docs/push.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

# pdproxy_push_heals_total's outcomes
HEAL_OUTCOMES = ("healed", "failed", "healed_later")


class PushMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.transfers = Counter(
            "pdproxy_push_transfers_total",
            "Push transfers by how their legs were sent: concurrent, or serial and why"
            " (serial: --push-dispatch serial; serial:unknown-prefill: its NIXL side not"
            " learned yet; serial:cold-decode: auto, the decode holds none of the prompt;"
            " serial:whole-answer: not streamed).",
            ("dispatch",),
            registry=registry,
        )
        self.heals = Counter(
            "pdproxy_push_heals_total",
            "Failed prefill legs of concurrent pushes sent again to the same prefill (same id"
            " and prompt) so that the waiting decode gets its KV, by outcome: healed or failed"
            " at once; healed_later: a stranded decode's blocks freed by a leg sent once its"
            " prefill was back.",
            ("outcome",),
            registry=registry,
        )
        self.stranded = Counter(
            "pdproxy_push_stranded_total",
            "Concurrent push decodes left waiting for KV that did not come (their blocks"
            " leak in vLLM 0.32): the decode is out of rotation until its KV usage is 0.",
            ("instance",),
            registry=registry,
        )
