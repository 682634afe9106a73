"""The scheduling benchmark's workloads, as data: what to send, when, with which headers. Pure.

Every prompt is made of synthetic words (`w<k>`), one sim token each, so a prompt's size in
tokens is its word count (plus a few for the chat template). `salt` starts every prompt and
system prompt, so two runs against the same engines never share prefix-cache blocks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

MODEL = "sim-model"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
SESSION_HEADER = "X-Session-Id"
_VOCAB = 4096


@dataclass(frozen=True)
class Timed:
    """One request of an open-loop workload, sent `at` seconds after the run starts."""

    at: float
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    kind: str  # "medium", "short", "long", "chat", "tenant" or "direct": TTFT per kind
    group: int = -1  # multi-tenant: the tenant whose system prefix starts the prompt
    target: int | None = None  # sent straight to this prefill (another client), not pdproxy


@dataclass(frozen=True)
class Sizes:
    """Request counts and prompt sizes of every workload (full run or --quick)."""

    hetero_rate: float = 8.0  # requests/s
    hetero_seconds: float = 10.0
    hetero_words: int = 512
    bursts: int = 5
    burst_every_s: float = 2.0
    burst_short: int = 24
    burst_long: int = 2
    short_words: int = 40
    long_words: int = 1200
    # Multi-turn chat as people use it: a short shared system prompt, and a history that
    # grows turn by turn until it is most of the prompt.
    sessions: int = 32
    system_prompts: int = 4
    turns: int = 10
    system_words: int = 16
    user_words: tuple[int, int] = (24, 48)
    think_s: tuple[float, float] = (0.3, 1.0)
    session_stagger_s: float = 2.0
    max_tokens: int = 32
    short_max_tokens: int = 16


QUICK = Sizes(hetero_seconds=3.0, bursts=2, sessions=8, turns=2, session_stagger_s=0.5)


def words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(_VOCAB)}" for _ in range(n))


def completion(prompt: str, max_tokens: int, user: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": user,
    }


def heterogeneous(sizes: Sizes, salt: str, seed: int = 1) -> list[Timed]:
    """A steady Poisson stream of medium prompts (±10 % in size), no prefix shared."""
    rng = random.Random(seed)
    out: list[Timed] = []
    at = rng.expovariate(sizes.hetero_rate)
    while at < sizes.hetero_seconds:
        n = round(sizes.hetero_words * rng.uniform(0.9, 1.1))
        prompt = f"{salt} m{len(out)} {words(rng, n)}"
        body = completion(prompt, sizes.max_tokens, f"user-{rng.randrange(64)}")
        out.append(Timed(at, COMPLETIONS, body, {}, "medium"))
        at += rng.expovariate(sizes.hetero_rate)
    return out


def bursty(sizes: Sizes, salt: str, seed: int = 2) -> list[Timed]:
    """Every `burst_every_s`: many short prompts and a few long ones within 50 ms."""
    rng = random.Random(seed)
    out: list[Timed] = []
    for b in range(sizes.bursts):
        start = b * sizes.burst_every_s
        kinds = ["short"] * sizes.burst_short + ["long"] * sizes.burst_long
        rng.shuffle(kinds)
        for kind in kinds:
            n = sizes.short_words if kind == "short" else sizes.long_words
            tokens = sizes.short_max_tokens if kind == "short" else sizes.max_tokens
            prompt = f"{salt} b{len(out)} {words(rng, n)}"
            body = completion(prompt, tokens, f"user-{rng.randrange(64)}")
            out.append(Timed(start + rng.uniform(0, 0.05), COMPLETIONS, body, {}, kind))
    return sorted(out, key=lambda t: t.at)


@dataclass(frozen=True)
class ChatSession:
    """One user's conversation: a shared system prompt and the user's turns, sent in order."""

    session_id: str
    user: str
    system: str
    user_turns: tuple[str, ...]
    start_at: float
    think_s: tuple[float, ...]  # pause after each answer, before the next turn


def chat_sessions(sizes: Sizes, salt: str, seed: int = 3) -> list[ChatSession]:
    """`sessions` conversations spread over `system_prompts` system prompts."""
    rng = random.Random(seed)
    systems = [
        f"{salt} system {k}: {words(rng, sizes.system_words)}" for k in range(sizes.system_prompts)
    ]
    out = []
    for i in range(sizes.sessions):
        turns = tuple(words(rng, rng.randint(*sizes.user_words)) for _ in range(sizes.turns))
        out.append(
            ChatSession(
                session_id=f"{salt}-s{i}",
                user=f"user-{i}",
                system=systems[i % len(systems)],
                user_turns=turns,
                start_at=rng.uniform(0, sizes.session_stagger_s),
                think_s=tuple(rng.uniform(*sizes.think_s) for _ in turns),
            )
        )
    return out


Message = dict[str, str]


def first_messages(session: ChatSession) -> list[Message]:
    return [
        {"role": "system", "content": session.system},
        {"role": "user", "content": session.user_turns[0]},
    ]


def next_messages(messages: list[Message], answer: str, user_text: str) -> list[Message]:
    """The next turn: the previous messages, the answer, then the new user message."""
    return [
        *messages,
        {"role": "assistant", "content": answer},
        {"role": "user", "content": user_text},
    ]


def chat_turn(session: ChatSession, messages: list[Message], max_tokens: int) -> Timed:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "user": session.user,
    }
    return Timed(0.0, CHAT, body, {SESSION_HEADER: session.session_id}, "chat")


@dataclass(frozen=True)
class Tenants:
    """The multi-tenant workload (issue 22 item 8): tenants with long shared system
    prefixes and short own suffixes, Zipf-ish popularity, prefix caches that hold only
    ``cache_tenants`` prompts each (so they evict), and a share of the requests from
    another client straight to a random prefill (pdproxy never hears of them)."""

    tenants: int = 24
    prefix_tokens: int = 512  # a multiple of the block: the prefix is whole blocks
    suffix_tokens: int = 64
    zipf_s: float = 0.8  # popularity of tenant k is 1 / (k + 1) ** zipf_s
    # requests/s, the other client's included: a busy fleet (at 12 the prefills rarely queue,
    # and every policy's p90 is a whole-prompt miss; docs/scheduling.md has both)
    rate: float = 16.0
    seconds: float = 40.0
    direct_share: float = 0.25
    prefills: int = 4
    cache_tenants: int = 5  # every engine's prefix cache holds this many whole prompts
    block: int = 16  # the sims' block size
    max_tokens: int = 16
    # one request at a time in the plan's order (a quiet fleet: nothing queues, only the
    # policy decides), instead of at the plan's times
    serial: bool = False

    @property
    def prompt_tokens(self) -> int:
        return self.prefix_tokens + self.suffix_tokens

    @property
    def cache_blocks(self) -> int:
        return self.cache_tenants * -(-self.prompt_tokens // self.block)


TENANTS_QUICK = Tenants(
    tenants=8, prefix_tokens=128, suffix_tokens=32, cache_tenants=2, rate=6.0, seconds=6.0
)


def multi_tenant(t: Tenants, salt: str, seed: int = 4) -> list[Timed]:
    """Poisson arrivals; each prompt is its tenant's prefix (``salt``, the tenant's tag,
    then words: ``prefix_tokens`` tokens) and a suffix of its own (``suffix_tokens``).
    ``salt`` must be one token (a word): the prefix then ends on a block boundary."""
    rng = random.Random(seed)
    prefixes = [
        f"{salt} tenant{k} {words(random.Random(seed * 1000 + k), t.prefix_tokens - 2)}"
        for k in range(t.tenants)
    ]
    weights = [1 / (k + 1) ** t.zipf_s for k in range(t.tenants)]
    out: list[Timed] = []
    at = rng.expovariate(t.rate)
    while at < t.seconds:
        tenant = rng.choices(range(t.tenants), weights)[0]
        n = len(out)
        prompt = f"{prefixes[tenant]} q{n} {words(rng, t.suffix_tokens - 1)}"
        if rng.random() < t.direct_share:
            body = completion(prompt, 1, f"other-{tenant}")
            out.append(
                Timed(at, COMPLETIONS, body, {}, "direct", tenant, rng.randrange(t.prefills))
            )
        else:
            body = completion(prompt, t.max_tokens, f"tenant-{tenant}")
            out.append(Timed(at, COMPLETIONS, body, {}, "tenant", tenant))
        at += rng.expovariate(t.rate)
    return out
