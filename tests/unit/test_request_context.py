"""The per-request record the legs fill in: retries, times, and what the access line says."""

from __future__ import annotations

import asyncio

from pdproxy.observability.request_context import (
    RequestTrace,
    bind,
    current,
    current_request_id,
    unbind,
)


def test_a_leg_after_a_failed_one_is_a_retry():
    trace = RequestTrace("/v1/completions")
    trace.prefill_started("r1", "http://p:1", 0, {})
    trace.decode_started("r1", "http://d:1", {})
    trace.leg_failed()
    trace.prefill_started("r2", "http://p:2", None, {})  # a fresh pair: one retry, not two
    trace.decode_started("r2", "http://d:2", {})
    fields = trace.access_fields()
    assert fields["retries"] == 1 and trace.request_id == "r2"
    assert (fields["prefill_url"], fields["decode_url"], fields["prefill_dp_rank"]) == (
        "http://p:2",
        "http://d:2",
        None,
    )


def test_access_fields_never_hold_a_body_and_times_are_ms():
    trace = RequestTrace("/v1/chat/completions", started=10.0)
    trace.first_byte, trace.finished, trace.status, trace.outcome = 10.25, 10.5, 200, "ok"
    fields = trace.access_fields()
    assert fields["ttfb_ms"] == 250.0 and fields["total_ms"] == 500.0
    assert fields["prefill_ms"] is None and fields["decode_only"] is False
    assert fields["prefill_sent_ms"] is None and fields["decode_sent_ms"] is None
    trace.prefill_sent, trace.prefill_ended, trace.decode_sent = 10.01, 10.05, 10.0625
    fields = trace.access_fields()
    assert (fields["prefill_sent_ms"], fields["prefill_ms"], fields["decode_sent_ms"]) == (
        10.0,
        40.0,
        62.5,
    )
    assert all(isinstance(v, (str, int, float, bool, type(None))) for v in fields.values())


async def test_tasks_a_request_starts_share_its_trace():
    trace = RequestTrace("/v1/completions")
    token = bind(trace)
    fixed = asyncio.Event()
    try:
        task = asyncio.create_task(_request_id_once(fixed))  # e.g. a concurrent prefill
        trace.request_id = "late-id"  # fixed after the task started: it still sees it
        fixed.set()
        assert await task == "late-id"
    finally:
        unbind(token)
    assert current_request_id() is None and current() is not trace


async def _request_id_once(fixed: asyncio.Event) -> str | None:
    await fixed.wait()
    return current_request_id()


def test_migrations_show_in_the_access_line_and_the_span():
    trace = RequestTrace("/v1/completions")
    assert trace.access_fields()["migrations"] is None
    assert "pdproxy.migrations" not in trace.span_attributes()
    hops = ["http://d:1 after 5 tokens (reset) -> http://p:1,http://d:2", "http://d:2 after 9"]
    trace.migrations = hops
    assert trace.access_fields()["migrations"] == hops
    assert trace.span_attributes()["pdproxy.migrations"] == "; ".join(hops)
