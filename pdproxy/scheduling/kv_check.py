"""The KV-event index checks itself against what the engines report. Pure.

Each prefill answer through PD carries the hit vLLM found
(``kv_transfer_params.remote_prefill_cached_tokens``); it is compared with what the index
predicted for that engine. A decode's answer says only the prefill's hit: its prediction
is checked by the first prompt block it stores (``kv_awaited``). A prediction a block or
more off is wrong (events lost without a gap showing, blocks evicted between the decision
and the leg, a hash the index keyed differently); ``bad_in_row`` wrong ones in a row and
the engine is distrusted: scored by the approximate index (``KVIndex.live`` loses it)
while its predictions go on being checked, and ``good_in_row`` right ones in a row trust
it again. Both changes are logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CheckFigures:
    """One engine rank's record, for ``/status``."""

    checked: int = 0
    wrong: int = 0
    predicted_tokens: int = 0
    actual_tokens: int = 0
    abs_error_tokens: int = 0
    in_row: int = 0  # wrong ones in a row while trusted, right ones while distrusted
    distrusted: bool = False


class SelfCheck:
    def __init__(self, *, bad_in_row: int = 5, good_in_row: int = 5) -> None:
        self.bad_in_row = bad_in_row
        self.good_in_row = good_in_row
        self.figures: dict[str, CheckFigures] = {}

    def record(self, name: str, predicted: int, actual: int, block_size: int) -> bool | None:
        """Checks one prediction; returns True when ``name`` becomes distrusted, False when
        trusted again, None when nothing changed."""
        f = self.figures.setdefault(name, CheckFigures())
        error = abs(predicted - actual)
        wrong = error >= max(block_size, 1)
        f.checked += 1
        f.wrong += wrong
        f.predicted_tokens += predicted
        f.actual_tokens += actual
        f.abs_error_tokens += error
        if f.distrusted:
            f.in_row = 0 if wrong else f.in_row + 1
            if f.in_row >= self.good_in_row:
                f.distrusted, f.in_row = False, 0
                logger.warning("KV events of %s predict right again: trusted", name)
                return False
            return None
        f.in_row = f.in_row + 1 if wrong else 0
        if f.in_row >= self.bad_in_row:
            f.distrusted, f.in_row = True, 0
            logger.warning(
                "KV events of %s predicted %d cached tokens where the engine found %d, "
                "%d times in a row: the approximate index scores it until they agree",
                name,
                predicted,
                actual,
                self.bad_in_row,
            )
            return True
        return None

    def forget(self, name: str) -> None:
        self.figures.pop(name, None)

    def distrusted(self, name: str) -> bool:
        f = self.figures.get(name)
        return f is not None and f.distrusted
