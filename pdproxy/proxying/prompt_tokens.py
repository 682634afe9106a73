"""A text request's token ids from the local tokenizer (``--tokenizer``), for the
``kv-events`` scorer, computed before the request is scheduled.

Only for a request whose model is scored by ``kv-events`` and that carries no token ids
of its own (a token-in request, or ``--render-once``'s rendering, already does). The ids
only feed scoring: the bodies sent to the engines are untouched. A prompt the tokenizer
cannot reproduce exactly is scored without them (``LocalTokenizer.prompt_ids``). Each
request's outcome is counted (``pdproxy_prompt_tokens_total``), so an operator sees how
much of the traffic is scored exactly.

Where it runs: a short prompt on the event loop (cheaper than a thread hand-off); a longer
one on this object's threads, through ``encode_batch``, which releases the GIL while Rust
encodes (``encode`` holds it), so the loop keeps serving other requests meanwhile.
``bench/tokenizer_micro.py`` measures both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pdproxy.scheduling.context import RequestFeatures
from pdproxy.wire.local_tokenizer import LocalTokenizer, prompt_chars

logger = logging.getLogger(__name__)

# Prompts up to this many characters are tokenized on the loop, longer ones on a thread:
# measured (bench/tokenizer_micro.py, SmolLM2), a hand-off costs the loop ~0.2 ms, and
# encoding about 0.5 ms per 1,000 characters.
INLINE_CHARS = 512
_THREADS = 2


class PromptTokens:
    """Fills ``RequestFeatures.token_ids`` of text requests; owns its threads
    (``close``)."""

    def __init__(
        self,
        tokenizers: Mapping[str, LocalTokenizer],
        wanted: Callable[[str | None], bool],
        *,
        inline_chars: int = INLINE_CHARS,
        count: Callable[[str], None] = lambda outcome: None,
    ) -> None:
        self._tokenizers = dict(tokenizers)  # model -> tokenizer; "" for every other model
        self._wanted = wanted
        self._count = count  # each text request's outcome (PROMPT_TOKEN_OUTCOMES)
        self._inline_chars = inline_chars
        self._pool: ThreadPoolExecutor | None = None

    async def fill(self, body: Mapping[str, Any], features: RequestFeatures) -> RequestFeatures:
        """``features`` with the prompt's token ids when they can be computed exactly."""
        if features.token_ids is not None or not self._wanted(features.model):
            return features
        tokenizer = self.tokenizer_for(features.model)
        if tokenizer is None:
            self._count("no_tokenizer")
            return features
        try:
            if prompt_chars(body) <= self._inline_chars:
                ids = tokenizer.prompt_ids(body)
            else:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="pdproxy-tokenize")
                loop = asyncio.get_running_loop()
                ids = await loop.run_in_executor(self._pool, tokenizer.prompt_ids, body, True)
        except Exception:  # the tokenizer's own failure costs exactness, never the request
            logger.debug("%s: tokenizing the prompt failed", tokenizer.name, exc_info=True)
            self._count("failed")
            return features
        if ids is None:
            self._count("unsupported")
            return features
        self._count("exact")
        return dataclasses.replace(features, token_ids=ids)

    def tokenizer_for(self, model: str | None) -> LocalTokenizer | None:
        own = self._tokenizers.get(model) if model else None
        return own if own is not None else self._tokenizers.get("")

    def close(self) -> None:
        """Stop the threads (a tokenization under way finishes; none is waited for)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
