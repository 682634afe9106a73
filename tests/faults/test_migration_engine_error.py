"""Mid-stream migration (issue 20) on the engine's own error event: a decode that streams
vLLM's ``data: {"error": ...}`` after k tokens (an internal error during generation) is cut
there, and the client's stream completes on another decode with the uninterrupted answer;
with no migration left, the client sees the engine's error event once."""

from __future__ import annotations

import dataclasses

import pytest

from tests.faults.harness import RETRY, assert_settled, fleet
from tests.faults.test_migration import Stream, answers, assert_same, migrated

pytestmark = pytest.mark.faults

ENGINE_ERROR = {"message": "Internal server error", "type": "InternalServerError", "code": 500}


def engine_errors(s: Stream) -> list[dict]:
    """The stream's error events; each must be the engine's own."""
    errors = [e["error"] for e in s.events if "error" in e]
    for error in errors:
        assert {k: error[k] for k in ENGINE_ERROR} == ENGINE_ERROR, error
    return errors


@pytest.mark.parametrize("kind", ["completions", "chat", "generate"])
@pytest.mark.parametrize("usage", [False, True])
@pytest.mark.parametrize("k", [1, 5])
async def test_an_engine_error_event_after_k_tokens_migrates_and_the_stream_is_whole(
    kind, usage, k
):
    async with fleet() as f:
        want = await answers(f, kind, 4, usage=usage)
        f.decodes[0].set_faults(error_after_tokens=k)
        got = await answers(f, kind, 4, usage=usage)
        assert_same(got, want, kind, usage)
        assert migrated(f, "engine_error") >= 1
        assert migrated(f) == 0  # counted as what it was, not as a reset
        await assert_settled(f)


async def test_with_limit_0_the_client_sees_the_engine_s_error_event_once():
    async with fleet(proxy={"retry": dataclasses.replace(RETRY, migration_limit=0)}) as f:
        f.decodes[0].set_faults(error_after_tokens=2)
        got = await answers(f, "chat", 4)
        cut = [g for g in got if g.error is not None]
        assert cut
        for g in cut:
            assert len(engine_errors(g)) == 1 and len(g.content) == 2
        assert migrated(f, "engine_error") == 0
        await assert_settled(f)


async def test_past_the_limit_the_client_sees_the_engine_s_error_event_once():
    retry = dataclasses.replace(RETRY, migration_limit=1)
    async with fleet(n_decode=3, proxy={"retry": retry}) as f:
        for d in f.decodes:
            d.set_faults(error_after_tokens=3)
        got = await answers(f, "completions", 2, usage=True)
        for g in got:
            assert len(engine_errors(g)) == 1
            assert len(g.content) == 6  # 3 + 3 after one migration
        outcome = {"reason": "engine_error", "outcome": "limit"}
        assert f.metric("pdproxy_migrations_total", **outcome) == 2
        await assert_settled(f)


async def test_under_render_once_an_engine_error_event_migrates_and_the_stream_is_whole():
    async with fleet(proxy={"render_once": True}) as f:
        want = await answers(f, "chat", 4, usage=True)
        f.decodes[0].set_faults(error_after_tokens=3)
        got = await answers(f, "chat", 4, usage=True)
        assert_same(got, want, "chat", True)
        assert migrated(f, "engine_error") >= 1
        await assert_settled(f)
