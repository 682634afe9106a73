"""bench.relay_micro drives the real per-token path: every token reaches the writer."""

from __future__ import annotations

import pytest

from bench.relay_micro import per_token_us


@pytest.mark.parametrize("migratable", [False, True])
async def test_every_token_goes_through_the_relay(migratable):
    assert await per_token_us(2000, migratable) > 0  # it asserts each token was written
