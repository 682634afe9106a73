"""Serving one generation request: inline when nothing needs to wait, else as a task."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from engines.sim import model, render
from engines.sim.config import Faults
from engines.sim.engine import Engine, Prefill
from engines.sim.errors import EngineDeadError, KVTransferError, error_body
from engines.sim.http import Connection
from engines.sim.openai_api import GenRequest
from engines.sim.records import RequestRecord

SSE = "text/event-stream; charset=utf-8"
DEAD = "EngineCore encountered an issue. See stack trace (above) for the root cause."
GENERATION_ERROR = "Internal server error"  # vLLM's GenerationError (finish_reason "error")


@dataclass
class Job:
    """One generation request in flight."""

    engine: Engine
    conn: Connection
    req: GenRequest
    rec: RequestRecord
    faults: Faults


def can_inline(job: Job) -> bool:
    """Serve without a task: no delays, no network pull, a free slot."""
    eng = job.engine
    scheduler = eng.rank_of(job.req).scheduler
    return (
        eng.config.instant
        and job.faults.hang_after_tokens is None
        and not eng.connector.must_fetch(job.req)
        and scheduler.running < scheduler.max_running
        and scheduler.waiting == 0
    )


def serve_inline(job: Job) -> None:
    pre = job.engine.prefill(job.req, job.engine.connector.load_now(job.req))
    pieces, out = _run_all(job, pre)
    _answer_whole(job, pieces, out)


def _answer_whole(job: Job, pieces: list[str], out: render.Outcome) -> None:
    """Send a fully generated response, or what the close/reset faults leave of it."""
    if _cut_short(job, pieces) or _errored(job, pieces):
        return
    if job.faults.reset_after_bytes is not None:
        _reset_after(job, pieces, out, int(job.faults.reset_after_bytes))
        return
    if job.req.stream:
        job.conn.start_stream(200, SSE)
        job.conn.write_chunk(render.stream_all(job.req, pieces, out))
        job.conn.end_stream()
    else:
        job.conn.send(200, render.full_body(job.req, out))
    job.rec.complete()


def _run_all(job: Job, pre: Prefill) -> tuple[list[str], render.Outcome]:
    pieces: list[str] = []
    reason, stop_reason = "length", None
    for piece, finish, stop in job.engine.steps(job.req, pre):
        pieces.append(piece)
        if finish is not None:
            reason, stop_reason = finish, stop
    out = job.engine.finish(job.req, pre, "".join(pieces), len(pieces), reason, stop_reason)
    return pieces, out


def _cut_short(job: Job, pieces: list[str]) -> bool:
    """Apply the close_after_tokens fault if this response is longer than its limit."""
    limit = job.faults.close_after_tokens
    if limit is None or limit >= len(pieces):
        return False
    _close_after(job, pieces, limit)
    return True


def _close_after(job: Job, pieces: list[str], limit: int) -> None:
    """The close_after_tokens fault: N streamed tokens (none if not streaming), then a cut."""
    if job.req.stream:
        job.conn.start_stream(200, SSE)
        head = [render.role_chunk(job.req)] if job.req.kind == "chat" else []
        head += [render.token_chunk(job.req, p) for p in pieces[:limit]]
        job.conn.write_chunk(b"".join(head))
    job.rec.fail(200 if job.req.stream else None, f"fault: closed after {limit} tokens")
    job.conn.abort()


def _errored(job: Job, pieces: list[str]) -> bool:
    """The error_after_tokens fault: N streamed tokens, then vLLM's error event and [DONE]
    in a 200 stream; a whole answer gets vLLM's 500."""
    limit = job.faults.error_after_tokens
    if limit is None or limit >= len(pieces):
        return False
    if job.req.stream:
        job.conn.start_stream(200, SSE)
        head = [render.role_chunk(job.req)] if job.req.kind == "chat" else []
        head += [render.token_chunk(job.req, p) for p in pieces[:limit]]
        job.conn.write_chunk(b"".join(head))
        _error_event(job, limit)
        return True
    job.conn.send(500, error_body(500, GENERATION_ERROR))
    job.rec.fail(500, f"fault: error after {limit} tokens")
    return True


def _error_event(job: Job, limit: int) -> None:
    """vLLM's mid-stream error event, byte for byte (its ``json.dumps`` separators), then
    ``[DONE]`` in a chunk of its own, as vLLM's generator yields them; the stream ends."""
    error = json.loads(error_body(500, GENERATION_ERROR))
    job.conn.write_chunk(b"data: " + json.dumps(error).encode() + b"\n\n")
    job.conn.write_chunk(render.DONE)
    job.conn.end_stream()
    job.rec.fail(200, f"fault: error after {limit} tokens")


def _reset_after(job: Job, pieces: list[str], out: render.Outcome, limit: int) -> None:
    """The reset_after_bytes fault: a 200, the first N bytes of the body, then an RST.

    For a stream the N bytes are of the SSE payload (chunk framing not counted).
    """
    job.rec.fail(200, f"fault: reset after {limit} bytes")
    if not job.req.stream:
        job.conn.send_truncated(200, render.full_body(job.req, out), limit)
        return
    job.conn.start_stream(200, SSE)
    job.conn.write_chunk(render.stream_all(job.req, pieces, out)[:limit])
    job.conn.reset()


async def serve_async(job: Job) -> None:
    """The slow path: wait for a slot, pull KV, pay prefill and decode time."""
    rank = job.engine.rank_of(job.req)
    try:
        await rank.scheduler.acquire(job.req.priority)
    except asyncio.CancelledError:
        _on_cancel(job)
        return
    blocks = job.engine.blocks_for(job.req)
    rank.running_blocks += blocks
    try:
        await _generate(job)
    except asyncio.CancelledError:
        _on_cancel(job)
    finally:
        rank.running_blocks -= blocks
        rank.scheduler.release()


async def _generate(job: Job) -> None:
    eng, req = job.engine, job.req
    try:
        loaded = await _fetch(job)
    except KVTransferError as exc:
        _fail_transfer(job, str(exc))
        return
    except EngineDeadError as exc:
        eng.dead = str(exc)
        _fail_transfer(job, DEAD)
        return
    pre = eng.prefill(req, loaded if loaded is not None else eng.connector.load_now(req))
    await asyncio.sleep(pre.overhead_s(eng.config))
    await eng.rank_of(req).compute(pre.compute_s(eng.config))
    if req.stream and job.faults.reset_after_bytes is None:
        await _stream(job, pre)
        return
    pieces, out = await _timed_pieces(job, pre)
    _answer_whole(job, pieces, out)


async def _fetch(job: Job) -> list[bytes] | None:
    """Remote KV for a decode that needs it; the fail_kv_load fault fails it without trying."""
    eng, req = job.engine, job.req
    if not eng.connector.must_fetch(req):
        return None
    if job.faults.fail_kv_load:
        eng.counters.kv_load_failures += 1
        raise KVTransferError(
            f"KV load failed for request {req.internal_id} (kv_load_failure_policy=fail)"
        )
    loaded = await eng.connector.fetch(req)
    tokens = req.prompt_tokens
    if loaded and tokens and not model.kv_is_for(req.model, tokens[0], loaded[0]):
        # Another model's (or adapter's) KV: vLLM would decode garbage from it, with no error.
        eng.counters.kv_load_failures += 1
        raise KVTransferError(
            f"KV for request {req.internal_id} was not produced by model {req.model!r}"
        )
    return loaded


def _fail_transfer(job: Job, message: str) -> None:
    """No KV for a decode that needs it: 500, or an error event in a 200 stream (as vLLM)."""
    body = error_body(500, message)
    if job.req.stream:
        job.conn.start_stream(200, SSE)
        job.conn.write_chunk(b"data: " + body + b"\n\n" + render.DONE)
        job.conn.end_stream()
        job.rec.fail(200, message)
        return
    job.conn.send(500, body)
    job.rec.fail(500, message)


async def _timed_pieces(job: Job, pre: Prefill) -> tuple[list[str], render.Outcome]:
    pieces: list[str] = []
    reason, stop_reason = "length", None
    pacer = _Pacer(job.engine.config.decode_tps)
    for piece, finish, stop in job.engine.steps(job.req, pre):
        await pacer.wait(len(pieces))
        await _hang_after(job, len(pieces))
        pieces.append(piece)
        if finish is not None:
            reason, stop_reason = finish, stop
    out = job.engine.finish(job.req, pre, "".join(pieces), len(pieces), reason, stop_reason)
    return pieces, out


async def _stream(job: Job, pre: Prefill) -> None:
    req, conn, eng = job.req, job.conn, job.engine
    conn.start_stream(200, SSE)
    if req.kind == "chat":
        conn.write_chunk(render.role_chunk(req))
    pacer = _Pacer(eng.config.decode_tps)
    pieces: list[str] = []
    limit, error_limit = job.faults.close_after_tokens, job.faults.error_after_tokens
    for piece, finish, stop in eng.steps(req, pre):
        await pacer.wait(len(pieces))
        if limit is not None and len(pieces) >= limit:
            job.rec.fail(200, f"fault: closed after {limit} tokens")
            conn.abort()
            return
        if error_limit is not None and len(pieces) >= error_limit:
            _error_event(job, error_limit)
            return
        await _hang_after(job, len(pieces))
        pieces.append(piece)
        if finish is None:
            conn.write_chunk(render.token_chunk(req, piece))
            await conn.drain()
            if conn.closed:
                raise asyncio.CancelledError
            continue
        out = eng.finish(req, pre, "".join(pieces), len(pieces), finish, stop)
        conn.write_chunk(render.token_chunk(req, piece, finish, stop, out.kv_transfer_params))
        if req.include_usage:
            conn.write_chunk(render.usage_chunk(req, out))
    conn.write_chunk(render.DONE)
    conn.end_stream()
    job.rec.complete()


class _Pacer:
    """Spaces tokens at 1/tps against an absolute clock (no drift); tps 0 never sleeps."""

    def __init__(self, tps: float) -> None:
        self.interval = 1.0 / tps if tps > 0 else 0.0
        self.start = time.monotonic()

    async def wait(self, index: int) -> None:
        if self.interval <= 0 or index == 0:
            return
        delay = self.start + index * self.interval - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)


async def serve_hang(job: Job) -> None:
    """The hang fault: accept the request and never answer (until the client leaves)."""
    try:
        await _forever()
    except asyncio.CancelledError:
        _on_cancel(job)


async def _hang_after(job: Job, sent: int) -> None:
    """The hang_after_tokens fault: before token N+1, wait until cancelled (slot held)."""
    limit = job.faults.hang_after_tokens
    if limit is not None and sent >= limit:
        await _forever()


async def _forever() -> None:
    await asyncio.get_running_loop().create_future()


def _on_cancel(job: Job) -> None:
    _abort(job.engine, job.conn, job.rec)


def _abort(engine: Engine, conn: Connection, rec: RequestRecord) -> None:
    """The client went away (or the server is stopping): record it like vLLM's abort.

    Called from connection_lost and again from the task's CancelledError; only the first
    call counts (a task cancelled before it started never runs its except clause).
    """
    if rec.outcome != "pending":
        return
    engine.counters.requests_finished_abort += 1
    if conn.state.stopping:
        rec.fail(None, "aborted: server stopping")
    elif conn.closed:
        engine.counters.client_disconnects += 1
        rec.disconnected()


def spawn(job: Job, coro: Coroutine[Any, Any, None]) -> None:
    """Run a request as its connection's task; a disconnect records it and cancels the task."""
    job.conn.on_lost = lambda: _on_cancel(job)
    job.conn.spawn(coro)


def spawn_hang(engine: Engine, conn: Connection, rec: RequestRecord) -> None:
    """The hang fault for a request that is no generation Job: accept, never answer."""

    async def hang() -> None:
        try:
            await _forever()
        except asyncio.CancelledError:
            _abort(engine, conn, rec)

    conn.on_lost = lambda: _abort(engine, conn, rec)
    conn.spawn(hang())


def spawn_delayed(
    engine: Engine, conn: Connection, rec: RequestRecord, delay_s: float, then: Callable[[], None]
) -> None:
    """The headers_delay_s fault: call `then` (which answers) after a delay sending nothing.

    A disconnect during the delay aborts the request, as one during generation does.
    """

    async def wait_then() -> None:
        try:
            await asyncio.sleep(delay_s)
        except asyncio.CancelledError:
            _abort(engine, conn, rec)
            return
        conn.on_lost = None
        then()

    conn.on_lost = lambda: _abort(engine, conn, rec)
    conn.spawn(wait_then())
