"""When to restart a worker that died (pure policy).

A worker that dies is restarted after a delay that doubles with each death in a row, from
``initial`` up to ``maximum``; one that had served for ``stable_after`` seconds before dying
starts the count again, so a crash once a day costs half a second, and a worker that cannot
start (a bad certificate, a full disk) is retried every ``maximum`` seconds without
spinning.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RestartBackoff:
    initial: float = 0.5
    maximum: float = 30.0
    stable_after: float = 30.0
    deaths_in_a_row: int = 0

    def delay(self, lived: float) -> float:
        """Seconds to wait before restarting a worker that died after ``lived`` seconds."""
        if lived >= self.stable_after:
            self.deaths_in_a_row = 0
        delay = min(self.maximum, self.initial * 2.0**self.deaths_in_a_row)
        self.deaths_in_a_row += 1
        return delay
