"""The order the fast tiers' files run in on ``make test``'s two xdist workers.

They run a whole file per worker (``--dist loadfile``) in the collection order
(``--no-loadscope-reorder``), with the files of ``LONG_FIRST`` moved to the front: xdist's
own order (most tests first) sent the one-test flow-control bench, 100 s of one worker,
last, and the other worker sat idle for most of it. Longest first, the run ends on
``tests/unit``'s many short files, which even the two workers out.
"""

from __future__ import annotations

import pytest

# Files that hold one worker a minute or more (the slowest durations of `make test`).
LONG_FIRST = ("tests/sim/test_bench_flow.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith(LONG_FIRST))  # stable: else as is
