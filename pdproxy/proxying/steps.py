"""The orchestrator's optional steps: each feature that adds work to some requests is one
``RequestStep``, built at start-up only when its flag is on (``pdproxy.build.request_path``
lists them, in order), and run by the orchestrator at its hooks. A deployment without the
feature has no step and pays nothing for it: the orchestrator loops over the steps that
override a hook (``StepHooks``), an empty tuple when none does.

The hooks, in a serial request's order (a step overrides the ones it needs):

- ``prepare``: before anything is picked (the prompt's tokens, a LoRA adapter loaded);
- ``before_prefill``: before the pair is picked (a wait for a prefill with room);
- ``view``: the instances the pick may choose from (those with room);
- ``picked``: the pair was picked (a deadline checked against the predicted first token);
- ``before_decode``: the prefill answered, or a concurrent transfer's legs start (a wait
  for a decode with room);
- ``after_prefill``: a response that ends the request instead of the decode leg (the first
  token from the prefill);
- ``answered``: a serial request's decode answered;
- ``close``: pdproxy stops.

Push (``--kv-connector nixl-push``) is not a step: it replaces how the legs run
(``PushLegs``), and the orchestrator hands them to it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

from pdproxy.connectors import Transfer
from pdproxy.errors import Overloaded
from pdproxy.proxying.deadlines import TtftPredictor
from pdproxy.proxying.exchange import ClientRequest, ProxyResponse
from pdproxy.proxying.first_token import FirstTokenPath
from pdproxy.proxying.kv_release import KVRelease
from pdproxy.proxying.leg_room import LegRoom
from pdproxy.proxying.lora_demand import LoraOnDemand
from pdproxy.proxying.prompt_tokens import PromptTokens
from pdproxy.proxying.run import Run
from pdproxy.types import Endpoint, PairDecision, Role, Snapshot
from pdproxy.wire.shaping import is_streaming

# The usable instances of a role serving a model, less the ones named (the orchestrator's
# pool: its retries' pool through the outlier filter).
Pool = Callable[[Role, str | None, Collection[str]], tuple[Endpoint, ...]]

BeforeDecode = Callable[[ClientRequest, Run, Transfer, dict[str, Any] | None], Awaitable[None]]
AfterPrefill = Callable[[ClientRequest, Transfer, dict[str, Any]], ProxyResponse | None]


class RequestStep:
    """An optional step: every hook does nothing unless a step overrides it."""

    async def prepare(self, request: ClientRequest, run: Run) -> None:
        """Before anything is picked; may replace ``run.features``."""

    async def before_prefill(self, request: ClientRequest, run: Run) -> None:
        """Before the pair is picked."""

    def view(self, snapshot: Snapshot) -> Snapshot:
        """The instances the pick may choose from."""
        return snapshot

    def picked(self, request: ClientRequest, decision: PairDecision, computed: float) -> None:
        """The pair was picked, its prefill to compute ``computed`` prompt tokens."""

    async def before_decode(
        self,
        request: ClientRequest,
        run: Run,
        transfer: Transfer,
        answer: dict[str, Any] | None,
    ) -> None:
        """The prefill answered ``answer`` (None: a concurrent transfer, its legs to start)."""

    def after_prefill(
        self, request: ClientRequest, transfer: Transfer, answer: dict[str, Any]
    ) -> ProxyResponse | None:
        """A response that ends the request instead of the decode leg, or None."""
        return None

    def answered(self, response: ProxyResponse) -> None:
        """A serial request's decode answered."""

    def close(self) -> None:
        """pdproxy stops."""


class StepHooks:
    """For each hook, the steps that override it, in the list's order."""

    __slots__ = (
        "after_prefill",
        "answered",
        "before_decode",
        "before_prefill",
        "close",
        "picked",
        "prepare",
        "steps",
        "view",
    )

    def __init__(self, steps: Sequence[RequestStep]) -> None:
        def overriding(hook: str) -> tuple[Any, ...]:
            base = getattr(RequestStep, hook)
            return tuple(
                getattr(step, hook) for step in steps if getattr(type(step), hook) is not base
            )

        self.steps = tuple(steps)
        self.prepare: tuple[Callable[[ClientRequest, Run], Awaitable[None]], ...]
        self.prepare = overriding("prepare")
        self.before_prefill: tuple[Callable[[ClientRequest, Run], Awaitable[None]], ...]
        self.before_prefill = overriding("before_prefill")
        self.view: tuple[Callable[[Snapshot], Snapshot], ...] = overriding("view")
        self.picked: tuple[Callable[[ClientRequest, PairDecision, float], None], ...]
        self.picked = overriding("picked")
        self.before_decode: tuple[BeforeDecode, ...] = overriding("before_decode")
        self.after_prefill: tuple[AfterPrefill, ...] = overriding("after_prefill")
        self.answered: tuple[Callable[[ProxyResponse], None], ...] = overriding("answered")
        self.close: tuple[Callable[[], None], ...] = overriding("close")


class PromptTokensStep(RequestStep):
    """``--tokenizer`` under kv-events: the prompt's tokens, for the exact KV match."""

    def __init__(self, tokens: PromptTokens) -> None:
        self.tokens = tokens

    async def prepare(self, request: ClientRequest, run: Run) -> None:
        run.features = await self.tokens.fill(request.body, run.features)

    def close(self) -> None:
        self.tokens.close()


class LoraStep(RequestStep):
    """``--lora-load-on-demand``: the request's adapter loaded where it may be served."""

    def __init__(self, lora: LoraOnDemand) -> None:
        self._lora = lora

    async def prepare(self, request: ClientRequest, run: Run) -> None:
        await self._lora.ensure(run.features)


class LegRoomStep(RequestStep):
    """Flow control: each leg waits, in the tenants' order, for an instance with room
    (``LegRoom``); the pick chooses among those with room, if any has."""

    def __init__(self, room: LegRoom, pool: Pool, release: KVRelease) -> None:
        self._room = room
        self._pool = pool
        self._release = release

    async def before_prefill(self, request: ClientRequest, run: Run) -> None:
        await self._wait(Role.PREFILL, request, run)

    def view(self, snapshot: Snapshot) -> Snapshot:
        with_room = self._room.with_room
        return Snapshot(with_room(snapshot.prefill), with_room(snapshot.decode))

    async def before_decode(
        self,
        request: ClientRequest,
        run: Run,
        transfer: Transfer,
        answer: dict[str, Any] | None,
    ) -> None:
        """A wait that ends in a 429 releases the KV the prefill holds for a decode that
        will never read it."""
        try:
            await self._wait(Role.DECODE, request, run)
        except Overloaded:
            if answer is not None:
                self._release.orphaned(request, transfer, answer, failed=None)
            raise

    async def _wait(self, role: Role, request: ClientRequest, run: Run) -> None:
        model, avoid = run.features.model, run.avoid if role is Role.DECODE else ()

        def pool() -> tuple[Endpoint, ...]:
            return self._pool(role, model, avoid)

        await self._room.wait(role, pool, request.ticket)


class DeadlineStep(RequestStep):
    """Flow control: a request with a deadline (``x-slo-ttft-ms``) whose first token is
    predicted past it is refused when its pair is picked (``TtftPredictor``)."""

    def __init__(self, deadlines: TtftPredictor) -> None:
        self._deadlines = deadlines

    def picked(self, request: ClientRequest, decision: PairDecision, computed: float) -> None:
        ticket = request.ticket
        if ticket.deadline is not None:
            self._deadlines.check(ticket, decision, computed, is_streaming(request.body))

    def answered(self, response: ProxyResponse) -> None:
        self._deadlines.observe_after_prefill(response.stream is not None)


class FirstTokenStep(RequestStep):
    """``--first-token-from-prefill``: the client's stream starts with the prefill's token
    (``FirstTokenPath``)."""

    def __init__(self, path: FirstTokenPath) -> None:
        self._path = path

    def after_prefill(
        self, request: ClientRequest, transfer: Transfer, answer: dict[str, Any]
    ) -> ProxyResponse | None:
        return self._path.answer(request, transfer, answer)
