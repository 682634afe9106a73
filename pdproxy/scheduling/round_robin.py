"""Round robin over prefills and decodes independently, and over P's data-parallel ranks."""

from __future__ import annotations

from pdproxy.errors import NoEndpointAvailable
from pdproxy.types import Endpoint, PairDecision, Snapshot


class RoundRobinScheduler:
    type_name = "round-robin"

    def __init__(self) -> None:
        self._prefill_turn = 0
        self._decode_turn = 0

    def schedule(self, snapshot: Snapshot) -> PairDecision:
        if not snapshot.prefill or not snapshot.decode:
            missing = "prefill" if not snapshot.prefill else "decode"
            raise NoEndpointAvailable(f"no {missing} instance is available")
        prefill, p_turn = self._next(snapshot.prefill, self._prefill_turn)
        decode, _ = self._next(snapshot.decode, self._decode_turn)
        self._prefill_turn += 1
        self._decode_turn += 1
        dp_size = prefill.dp_size
        rank = (p_turn // len(snapshot.prefill)) % dp_size if dp_size > 1 else None
        return PairDecision(prefill, decode, rank)

    @staticmethod
    def _next(endpoints: tuple[Endpoint, ...], turn: int) -> tuple[Endpoint, int]:
        return endpoints[turn % len(endpoints)], turn
