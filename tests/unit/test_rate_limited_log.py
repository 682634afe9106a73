"""RateLimitedLogger: one line per key per interval, and a bounded table of keys."""

from __future__ import annotations

import logging

import pytest

from pdproxy.observability.log import RateLimitedLogger


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_a_key_logs_once_per_interval_and_counts_what_it_held(caplog, clock):
    log = RateLimitedLogger(logging.getLogger("t.rl"), clock, interval=10)
    with caplog.at_level(logging.WARNING, "t.rl"):
        for _ in range(5):
            log.warning("k", "bad %s", "thing")
        clock.now = 10
        log.warning("k", "bad %s", "thing")
    assert _lines(caplog) == ["bad thing", "bad thing (4 similar messages suppressed)"]


def test_a_flood_of_distinct_keys_keeps_the_table_bounded(caplog, clock):
    log = RateLimitedLogger(logging.getLogger("t.rl"), clock, interval=10, max_keys=8)
    with caplog.at_level(logging.WARNING, "t.rl"):
        for i in range(10_000):
            log.warning(f"value:{i}", "ignored %d", i)
    # 8 keys logged, then every newcomer shares the overflow key: one more line, the rest held
    assert len(_lines(caplog)) == 9
    assert len(log._next) <= 9 and len(log._held) <= 9
    clock.now = 10  # past the interval: old keys make room again
    with caplog.at_level(logging.WARNING, "t.rl"):
        log.warning("fresh", "fresh key")
    assert _lines(caplog)[-1] == "fresh key"
    assert "fresh" in log._next and len(log._next) <= 9
