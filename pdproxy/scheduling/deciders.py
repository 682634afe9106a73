"""Deciders: is a request worth a prefill, or does a decode alone serve it better?"""

from __future__ import annotations

from dataclasses import dataclass

from pdproxy.scheduling.context import Context


class AlwaysDisaggregate:
    type_name = "always-disaggregate"

    def disaggregate(self, ctx: Context, cached_tokens: float) -> bool:
        return True


@dataclass(frozen=True, slots=True)
class PromptSizeDecider:
    """Disaggregate when the estimated *uncached* prompt (the estimate less the best
    prefix-index hit on a prefill) is at least ``threshold_tokens`` (llm-d's
    prefill-size threshold): a short prompt costs less to compute on the decode than to
    transfer."""

    threshold_tokens: int
    type_name = "prompt-size-decider"

    def disaggregate(self, ctx: Context, cached_tokens: float) -> bool:
        return ctx.features.tokens - cached_tokens >= self.threshold_tokens
