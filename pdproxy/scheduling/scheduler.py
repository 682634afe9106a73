"""The scheduler: runs a policy per role and the decider for one request.

a request vLLM cannot split (``features.one_leg_reason``) → a decode alone;
prefill candidates → decider (with the best prefix-index hit on a prefill) →
prefill policy (and a DP rank on it) → decode policy. With no prefill routable the
request fails with 503, or goes to a decode alone under ``--decode-only-fallback``.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from pdproxy.config.scheduling import SchedulingConfig
from pdproxy.errors import BadRequest, NoEndpointAvailable
from pdproxy.scheduling import Decider
from pdproxy.scheduling.context import Context, RequestFeatures
from pdproxy.scheduling.deciders import AlwaysDisaggregate, PromptSizeDecider
from pdproxy.scheduling.features import FeatureConfig, extract
from pdproxy.scheduling.kv_events import KVIndex
from pdproxy.scheduling.kv_keys import instance_name
from pdproxy.scheduling.kv_scorer import predicted_tokens, prompt_keys
from pdproxy.scheduling.policies import RolePolicy, build_policy
from pdproxy.scheduling.ranks import RankChooser
from pdproxy.scheduling.scorers import prefix_matches
from pdproxy.scheduling.speed import SpeedTracker
from pdproxy.scheduling.view import EndpointView
from pdproxy.types import DecodeOnly, Endpoint, PairDecision, Role, Snapshot
from pdproxy.wire.kv_params import KV_TRANSFER_PARAMS, REMOTE_PREFILL_CACHED_TOKENS

KV_EVENTS = "kv-events"
SHORT_PROMPT = "short_prompt"
NO_PREFILL = "no_prefill"


class Scheduler:
    def __init__(
        self,
        config: SchedulingConfig,
        *,
        clock: Callable[[], float],
        rng: random.Random,
        max_age: float,
        decode_alone: bool = True,
    ) -> None:
        # False (P2P-NCCL: a decode always waits for its prefill's KV): a request vLLM
        # cannot split is refused (400) rather than sent to a decode that would fail it.
        self._decode_alone = decode_alone
        # The fleet's KV-event index: fed by the subscribers, read by ``kv-events``.
        self.kv_index = KVIndex(
            config.prefix_index_max_blocks, stale_after=config.kv_events_stale_secs
        )
        self.prefill = build_policy(config.prefill_policy, config, rng, self.kv_index, Role.PREFILL)
        self.decode = build_policy(config.decode_policy, config, rng, self.kv_index, Role.DECODE)
        # --model-policy: a model's own pair of policies (one dict hit when any is set)
        self._by_model = {
            model: (
                build_policy(p, config, rng, self.kv_index, Role.PREFILL),
                build_policy(d, config, rng, self.kv_index, Role.DECODE),
            )
            for model, p, d in config.model_policies
        }
        # whether the fleet's policies, and each --model-policy model's, read token ids
        self._fleet_kv_events = KV_EVENTS in (config.prefill_policy, config.decode_policy)
        self._kv_events_models = {
            model: KV_EVENTS in (p, d) for model, p, d in config.model_policies
        }
        self.kv_events = self._fleet_kv_events or any(self._kv_events_models.values())
        self._decider: Decider = (
            PromptSizeDecider(config.pd_threshold_tokens)
            if config.pd_threshold_tokens > 0
            else AlwaysDisaggregate()
        )
        self.decode_only_fallback = config.decode_only_fallback
        self._features = FeatureConfig(config.chars_per_token, config.prefix_block_chars)
        self._want_blocks = any(
            policy.index is not None for pair in self._pairs() for policy in pair
        )
        self._clock = clock
        self._max_age = max_age
        self._ranks = {Role.PREFILL: RankChooser(), Role.DECODE: RankChooser()}
        self.speeds = SpeedTracker()  # fed by the orchestrator with each prefill leg's time

    def features(self, body: Mapping[str, Any], session: str | None) -> RequestFeatures:
        return extract(
            body,
            session,
            self._features,
            want_blocks=self._want_blocks,
            want_token_ids=self.kv_events,
        )

    def wants_token_ids(self, model: str | None) -> bool:
        """Whether a request for ``model`` is scored by a ``kv-events`` policy (on either
        leg), so that computing its token ids is worth it."""
        if model is not None and model in self._kv_events_models:
            return self._kv_events_models[model]
        return self._fleet_kv_events

    def schedule(self, features: RequestFeatures, snapshot: Snapshot) -> PairDecision | DecodeOnly:
        """A prefill and a decode, or a decode alone; raises ``NoEndpointAvailable``."""
        if not snapshot.decode:
            raise NoEndpointAvailable(f"no decode instance{_serving(features)} is available")
        ctx = Context(features, self._clock(), self._max_age)
        if features.one_leg is not None:  # vLLM cannot split it across two legs
            if not self._decode_alone:
                raise BadRequest(
                    f"this deployment cannot serve {features.one_leg.replace('_', ' ')}"
                    " (n or best_of > 1, prompt_logprobs, echo with logprobs): vLLM cannot"
                    " split it across a prefill and a decode, and its decodes cannot serve"
                    " a request alone"
                )
            return self._decode_only(ctx, snapshot.decode, features.one_leg)
        if not snapshot.prefill:
            if not self.decode_only_fallback:
                raise NoEndpointAvailable(f"no prefill instance{_serving(features)} is available")
            return self._decode_only(ctx, snapshot.decode, NO_PREFILL)
        prefill_policy, decode_policy = self._policies(features)
        if self.kv_events:
            self.kv_index.sweep(ctx.now)  # ranks whose events stopped are scored approximately
        if not self._decider.disaggregate(ctx, self._cached_tokens(ctx, prefill_policy)):
            return self._decode_only(ctx, snapshot.decode, SHORT_PROMPT)
        prefill = _owned(prefill_policy.choose(ctx, snapshot.prefill))
        decode = _owned(decode_policy.choose(ctx, snapshot.decode))
        decision = PairDecision(
            prefill,
            decode,
            self._ranks[Role.PREFILL].choose(ctx, prefill),
            self._ranks[Role.DECODE].choose(ctx, decode),
        )
        if not self.kv_events:  # nothing new per request when the policy is off
            return decision
        decision = dataclasses.replace(
            decision,
            prefill_cached=predicted_tokens(ctx, self.kv_index, prefill),
            decode_cached=predicted_tokens(ctx, self.kv_index, decode),
        )
        self._expect_events(ctx, decision)
        return decision

    def _expect_events(self, ctx: Context, decision: PairDecision) -> None:
        """Each leg whose prompt has whole blocks its engine is not predicted to hold
        will make it publish: its events' staleness clock starts (``kv_stale``)."""
        ids = ctx.features.token_ids
        size = self.kv_index.block_size
        if ids is None or size < 1:
            return
        whole = len(ids) // size * size
        legs = (
            (decision.prefill, decision.prefill_dp_rank, decision.prefill_cached),
            (decision.decode, decision.decode_dp_rank, decision.decode_cached),
        )
        for endpoint, rank, cached in legs:
            if cached is not None and cached < whole:
                self.kv_index.expect(instance_name(endpoint.url, rank or 0), ctx.now)
        cached, decode = decision.decode_cached, decision.decode
        if cached is not None and cached < whole and decode.dp_size <= 1:
            # vLLM's answer reports the prefill's hit, not the decode's: the decode's is
            # the first block of the prompt it stores (``kv_awaited``)
            keys = prompt_keys(ctx, self.kv_index, ids)
            self.kv_index.await_stores(instance_name(decode.url, 0), keys, cached, ctx.now)

    def pick(
        self, role: Role, features: RequestFeatures, candidates: Sequence[Endpoint]
    ) -> tuple[Endpoint, int | None]:
        """Another instance of ``role`` (and its DP rank) for a retry."""
        if not candidates:
            raise NoEndpointAvailable(f"no {role.value} instance{_serving(features)} is available")
        ctx = Context(features, self._clock(), self._max_age)
        policies = self._policies(features)
        policy = policies[0] if role is Role.PREFILL else policies[1]
        chosen = _owned(policy.choose(ctx, candidates))
        return chosen, self._ranks[role].choose(ctx, chosen)

    def verify_prefill(
        self, decision: PairDecision, answer: Mapping[str, Any]
    ) -> tuple[int, int] | None:
        """The prefill's answer says what it found cached (vLLM's
        ``kv_transfer_params.remote_prefill_cached_tokens``): the KV-event index checks its
        prediction against it (``kv_check``). Only for one-rank prefills, whose hit is the
        rank the prediction was made for. Returns (predicted, actual) when checked."""
        predicted = decision.prefill_cached
        params = answer.get(KV_TRANSFER_PARAMS)
        if predicted is None or decision.prefill.dp_size > 1 or not isinstance(params, dict):
            return None
        actual = params.get(REMOTE_PREFILL_CACHED_TOKENS)
        if not isinstance(actual, int) or isinstance(actual, bool):
            return None
        self.kv_index.verify(instance_name(decision.prefill.url, 0), predicted, actual)
        return predicted, actual

    def forget(self, url: str) -> None:
        """An instance left the fleet: drop it from the prefix indexes."""
        for pair in self._pairs():
            for policy in pair:
                if policy.index is not None:
                    policy.index.forget(url)

    def _policies(self, features: RequestFeatures) -> tuple[RolePolicy, RolePolicy]:
        """The request's model's own policies (``--model-policy``), else the fleet's."""
        if self._by_model and features.model is not None:
            own = self._by_model.get(features.model)
            if own is not None:
                return own
        return self.prefill, self.decode

    def _pairs(self) -> list[tuple[RolePolicy, RolePolicy]]:
        return [(self.prefill, self.decode), *self._by_model.values()]

    def _decode_only(self, ctx: Context, decodes: Sequence[Endpoint], reason: str) -> DecodeOnly:
        decode = _owned(self._policies(ctx.features)[1].choose(ctx, decodes))
        return DecodeOnly(decode, reason, self._ranks[Role.DECODE].choose(ctx, decode))

    def _cached_tokens(self, ctx: Context, prefill: RolePolicy) -> float:
        index = prefill.index
        blocks = ctx.features.blocks
        if index is None or not blocks or isinstance(self._decider, AlwaysDisaggregate):
            return 0.0
        depths = prefix_matches(ctx, index)
        if not depths:
            return 0.0
        share = max(depths.values()) / len(blocks)
        return ctx.features.tokens * share


def _serving(features: RequestFeatures) -> str:
    """What a 503 names: the model no routable instance serves, when the request named one."""
    return "" if features.model is None else f" serving model {features.model!r}"


def _owned(chosen: EndpointView) -> Endpoint:
    """The endpoint a policy chose, as the request path that writes its legs holds it.
    Policies return one of the endpoints they were given (``Endpoint`` objects seen
    through the read-only ``EndpointView``), so this only restores the type."""
    return cast(Endpoint, chosen)
