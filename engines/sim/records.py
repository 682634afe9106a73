"""The record of every request the sim received, for /sim/requests and test assertions."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

Outcome = str  # "pending" | "completed" | "client_disconnected" | "error"


@dataclass
class RequestRecord:
    seq: int
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    arrival: float = field(default_factory=time.time)
    outcome: Outcome = "pending"
    status: int | None = None
    error: str | None = None
    finished_at: float | None = None
    disconnected_at: float | None = None

    def complete(self, status: int = 200) -> None:
        self.outcome, self.status, self.finished_at = "completed", status, time.time()

    def fail(self, status: int | None, error: str) -> None:
        self.outcome, self.status, self.error = "error", status, error
        self.finished_at = time.time()

    def disconnected(self) -> None:
        now = time.time()
        self.outcome, self.disconnected_at, self.finished_at = "client_disconnected", now, now

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Recorder:
    """Keeps the newest `limit` records."""

    def __init__(self, limit: int) -> None:
        self._records: deque[RequestRecord] = deque(maxlen=limit)
        self._seq = 0

    def add(self, method: str, path: str, headers: dict[str, str], body: Any) -> RequestRecord:
        self._seq += 1
        rec = RequestRecord(self._seq, method, path, headers, body)
        self._records.append(rec)
        return rec

    def all(self) -> list[RequestRecord]:
        return list(self._records)

    def clear(self) -> None:
        self._records.clear()
