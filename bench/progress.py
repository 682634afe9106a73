"""The benchmark's progress bar: requests done over requests planned, on stderr.

Shown when stderr is a terminal (``auto``) or when asked (``always``), so a redirected run's
output and CI logs stay clean; stdout carries only the results.
"""

from __future__ import annotations

import sys
from typing import Literal

from tqdm import tqdm

Mode = Literal["auto", "always", "never"]
MODES: tuple[Mode, ...] = ("auto", "always", "never")


def shown(mode: Mode, isatty: bool) -> bool:
    return mode == "always" or (mode == "auto" and isatty)


class Progress:
    """One bar for the whole run; ``stage`` names what is being measured now."""

    def __init__(self, total: int, mode: Mode = "auto") -> None:
        self._bar = tqdm(
            total=total,
            unit="req",
            file=sys.stderr,
            disable=not shown(mode, sys.stderr.isatty()),
            dynamic_ncols=True,
            mininterval=0.25,
            leave=True,
        )

    def stage(self, text: str) -> None:
        self._bar.set_description_str(text, refresh=False)

    def advance(self) -> None:
        self._bar.update(1)

    def note(self, text: str) -> None:
        """A line above the bar (or plainly on stderr when there is no bar)."""
        tqdm.write(text, file=sys.stderr)

    def close(self) -> None:
        self._bar.close()
