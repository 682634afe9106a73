"""A subscriber to one engine rank's KV cache events (vLLM's ``ZmqEventPublisher``).

On the event loop (``zmq.asyncio``, no threads). A SUB socket on the engine's publisher
with its topic; on start, and whenever the sequence says so (``scheduling.kv_sequence``),
a DEALER asks the replay socket (a ROUTER) for the batches from a number on: it answers
``(b"", topic, seq, payload)`` for each buffered batch from there, then
``(b"", b"", -1, b"")``. A publisher that disconnects and comes back is rebuilt from its
replay (``_on_connection``). Without a replay endpoint, or when the replay does not answer
within ``replay_timeout``, the subscriber goes on from what it hears live.

A malformed message (a frame count other than 3, a sequence number that is not 8 bytes, a
payload that does not decode as vLLM's batch) is counted and dropped; it never stops the
subscriber. Only cancellation ends ``run``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdproxy.observability.log import RateLimitedLogger
from pdproxy.scheduling.kv_events import (
    Cleared,
    KVIndex,
    MalformedEvents,
    decode_batch,
    pieces,
)
from pdproxy.scheduling.kv_sequence import Action, SequenceTracker

logger = logging.getLogger(__name__)

_END = (-1).to_bytes(8, "big", signed=True)
# Batches queued for one subscriber: vLLM sends one an engine step and pdproxy takes each
# in well under a millisecond, so 64 wait only when the loop was held far longer than any
# request bears. Past it ZMQ drops them, a gap the replay fills; what it bounds is the
# memory a publisher faster than pdproxy can take (64 x _MAX_BYTES).
_RECV_HWM = 64
# A batch larger than this is not vLLM's: one engine step stores at most its batched
# tokens' blocks (a whole 128k-token prompt at block size 16 is 0.75 MiB of events).
# Decoding a batch holds the event loop (about 15 ms a MiB here, for each rank that
# receives it), so the bound is the longest a publisher can hold it; ZMQ drops a larger
# message and the connection that sent it.
_MAX_BYTES = 2 << 20
# Blocks applied to the index between two yields to the event loop (about 2 ms of work)
_TURN_BLOCKS = 1024
# A replay is vLLM's buffer (10,000 batches, sent at once): one that goes on past that
# many batches or replay timeouts is a broken or hostile publisher, left for the live feed
_REPLAY_BATCHES = 10_000
_REPLAY_TIMEOUTS = 10


@dataclass(slots=True)
class SubscriberStats:
    batches: int = 0
    malformed: int = 0
    replays: int = 0
    replay_failures: int = 0
    reconnects: int = 0
    last_batch_at: float | None = None  # monotonic, for staleness


class KVEventSubscriber:
    """Feeds ``index`` under the name ``instance`` (one engine's URL and rank) from
    ``endpoint`` (and ``replay_endpoint``, if any)."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        index: KVIndex,
        instance: str,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        replay_timeout: float = 2.0,
    ) -> None:
        self._context = context
        self._index = index
        self.instance = instance
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._replay_timeout = replay_timeout
        self.sequence = SequenceTracker()
        self.stats = SubscriberStats()
        self.ready = asyncio.Event()  # subscribed and the first replay done
        self._disconnected = False
        self.replaced = False  # a successor follows the same name: leave its entries alone
        self._log = RateLimitedLogger(logger, time.monotonic)  # a publisher sends anything

    async def run(self) -> None:
        sock = self._context.socket(zmq.SUB)
        sock.setsockopt(zmq.RCVHWM, _RECV_HWM)
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_BYTES)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            sock.setsockopt(zmq.SUBSCRIBE, self._topic)
            sock.connect(self.endpoint)
            self._index.clear(self.instance)  # a predecessor's entries, if any
            await self._replay(0)  # what the engine already holds, as far as its buffer goes
            self._index.follow(self.instance)
            self.ready.set()
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    await self._on_connection(await monitor.recv_multipart())
                if sock in ready:
                    await self._on_frames(await sock.recv_multipart(copy=True))
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            if not self.replaced:
                self._index.unfollow(self.instance)
                self._index.release(self.instance)

    async def _on_frames(self, frames: list[bytes]) -> None:
        try:
            await self._on_live(frames)
        except Exception as exc:  # never stop following: the next batch may be sound
            self.stats.malformed += 1
            self._log.warning(
                "failed",
                "KV events of %s: batch not applied (%s)",
                self.instance,
                type(exc).__name__,
            )

    async def _on_connection(self, message: list[bytes]) -> None:
        """A publisher that went away and came back (a restarted engine, or the network):
        nothing says what it published meanwhile, nor whether it is the same process, so
        its entries are rebuilt from its replay buffer (vLLM numbers a new process from 0,
        and a lost first batch would leave the restart unseen)."""
        event = parse_monitor_message(message)["event"]
        if event == zmq.EVENT_DISCONNECTED:
            self._disconnected = True
        elif event == zmq.EVENT_CONNECTED and self._disconnected:
            self._disconnected = False
            self.stats.reconnects += 1
            logger.info("KV events of %s: publisher back, rebuilding", self.instance)
            await self._clear()
            self.sequence.reset()
            await self._replay(0)

    async def _on_live(self, frames: list[bytes]) -> None:
        parsed = self._parse(frames)
        if parsed is None:
            return
        seq, ts, events = parsed
        if events is None:  # numbered, undecodable: its number is taken all the same
            self.sequence.dropped(seq)
            return
        action = self.sequence.live(seq, ts)
        if action is Action.APPLY:
            await self._apply(events)
            return
        if action is Action.SKIP:
            return
        if action is Action.RESTART:
            logger.warning("KV events of %s restarted at %d: rebuilding", self.instance, seq)
            await self._clear()
        # Awaited inline: the SUB socket queues meanwhile (up to _RECV_HWM; past it a gap,
        # replayed in turn), and the batches the replay covered are then skipped by their
        # number and timestamp.
        await self._replay(self.sequence.next or 0)
        await self._take_replayed(seq, ts, events)

    async def _take_replayed(self, seq: int, ts: float, events: list[Any]) -> None:
        action = self.sequence.replayed(seq, ts)
        if action is Action.RESTART:  # the gap could not be filled: rebuild from here
            logger.warning("KV events of %s: gap not replayed, rebuilding", self.instance)
            await self._clear()
        if action is not Action.SKIP:
            await self._apply(events)

    async def _replay(self, start: int) -> None:
        if self.replay_endpoint is None:
            return
        self.stats.replays += 1
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, _MAX_BYTES)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._replay_timeout * _REPLAY_TIMEOUTS
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            for _ in range(_REPLAY_BATCHES + 1):
                wait = min(self._replay_timeout, deadline - loop.time())
                frames = await asyncio.wait_for(dealer.recv_multipart(), max(wait, 0.0))
                if len(frames) == 4 and frames[2] == _END:
                    return
                parsed = self._parse(frames[1:])
                if parsed is None:
                    continue
                seq, ts, events = parsed
                if events is None:
                    self.sequence.dropped(seq)
                else:
                    await self._take_replayed(seq, ts, events)
            self.stats.replay_failures += 1
            logger.warning("KV events replay of %s: endless, left", self.instance)
        except TimeoutError:
            self.stats.replay_failures += 1
            logger.warning("KV events replay of %s: no end in time", self.instance)
        finally:
            dealer.close(linger=0)

    def _parse(self, frames: list[bytes]) -> tuple[int, float, list[Any] | None] | None:
        """(sequence number, timestamp, events); the events are None for a numbered batch
        whose payload is not vLLM's (its number still counts); None when not even the
        framing is. Counted, and logged at most once per 10 s per kind."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.malformed += 1
            self._log.warning(
                "framing",
                "KV events of %s: a message of %d frames dropped",
                self.instance,
                len(frames),
            )
            return None
        seq = int.from_bytes(frames[1], "big")
        try:
            batch = msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
            events, _rank = decode_batch(batch)
            ts = batch[0]
            if not isinstance(ts, int | float) or isinstance(ts, bool) or ts != ts:
                raise MalformedEvents("a batch's timestamp is a number")
        except Exception as exc:  # msgpack and the decoder raise many types on garbage
            self.stats.malformed += 1
            self._log.warning(
                "payload",
                "KV events of %s: malformed batch %d dropped (%s)",
                self.instance,
                seq,
                type(exc).__name__,
            )
            return seq, 0.0, None
        return seq, float(ts), list(events)

    async def _apply(self, events: list[Any]) -> None:
        """``events`` into the index, ``_TURN_BLOCKS`` at a time: a batch of a million
        blocks must not hold the loop (requests meanwhile match a partly applied batch,
        as they would a batch not yet received). A clear takes out what this engine held,
        in turns too (``_clear``)."""
        first = True
        for turn in pieces(events, _TURN_BLOCKS):
            if not first:
                await asyncio.sleep(0)
            first = False
            run: list[Any] = []
            for event in turn:
                if isinstance(event, Cleared):
                    self._index.apply(self.instance, run)
                    run = []
                    await self._clear()
                else:
                    run.append(event)
            self._index.apply(self.instance, run)
        self._index.heard(self.instance)
        self.stats.batches += 1
        self.stats.last_batch_at = time.monotonic()

    async def _clear(self) -> None:
        """Everything this engine held leaves the index, ``_TURN_BLOCKS`` keys a turn (a
        full index's clear held the loop 0.7 s; ten of them in one 414-byte batch, 15 s)."""
        keys = self._index.detach(self.instance)
        for start in range(0, len(keys), _TURN_BLOCKS):
            if start:
                await asyncio.sleep(0)
            self._index.drop(self.instance, keys[start : start + _TURN_BLOCKS])

    async def aclose(self, task: asyncio.Task[None]) -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
