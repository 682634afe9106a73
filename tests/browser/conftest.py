"""A real headless Chromium for the browser tier: Debian's ``chromium`` package driven by
Playwright (which then downloads no browser of its own). Without either, the tests skip
and say why; ``make test`` installs chromium (tests/install-tools.sh), the test extra
Playwright."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

# The binary itself first: Debian's /usr/bin/chromium is a wrapper script.
CANDIDATES = ("/usr/lib/chromium/chromium", "chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    """``$PDPROXY_CHROMIUM`` if set (and executable), else the first Chromium found."""
    explicit = os.environ.get("PDPROXY_CHROMIUM")
    names = (explicit,) if explicit else CANDIDATES
    for name in names:
        path = name if Path(name).is_file() else shutil.which(name)
        if path and os.access(path, os.X_OK):
            return path
    return None


@pytest.fixture(scope="session")
def chromium() -> str:
    pytest.importorskip(
        "playwright.async_api", reason="playwright is not installed (pip install -e '.[test]')"
    )
    path = find_chromium()
    if path is None:
        pytest.skip(
            "no Chromium found (apt-get install chromium, or set PDPROXY_CHROMIUM): "
            "the dashboard's browser test did not run"
        )
    return path
