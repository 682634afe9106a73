"""The KV event subscriber against a publisher speaking vLLM's wire format on real ZMQ
sockets (loopback): replay on connect, gaps, restarts, removals, malformed batches."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable

import msgpack
import pytest
import zmq.asyncio

from engines.sim.kv_events import KVEventPublisher, cleared, removed, stored
from pdproxy.membership.kv_subscriber import KVEventSubscriber
from pdproxy.scheduling.kv_events import KVIndex
from pdproxy.scheduling.kv_keys import block_keys

TOKENS = list(range(1000, 1064))  # 4 blocks of 16
KEYS = block_keys(TOKENS, 16)
URL = "http://e:1|0"


async def until(cond: Callable[[], bool], timeout: float = 3.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


class Pair:
    def __init__(self, pub: KVEventPublisher, sub: KVEventSubscriber, index: KVIndex) -> None:
        self.pub, self.sub, self.index = pub, sub, index

    def store(self, hashes: list[int], parent: int | None, first_block: int) -> None:
        tokens = TOKENS[first_block * 16 : (first_block + len(hashes)) * 16]
        self.pub.publish([stored(hashes, parent, tokens, 16, self.pub.encoding)])

    def depth(self) -> int:
        return self.index.match(KEYS).get(URL, 0)

    async def joined(self) -> None:
        """Past ZMQ's slow joiner: a live batch has reached the subscriber."""
        await self.sub.ready.wait()
        for _ in range(300):
            if self.sub.stats.batches:
                return
            self.pub.publish([cleared(self.pub.encoding)])
            await asyncio.sleep(0.01)
        raise AssertionError("the subscriber never joined")


@contextlib.asynccontextmanager
async def pair(
    encoding: str = "map",
    replay: bool = True,
    before: Callable[[KVEventPublisher], None] = lambda p: None,
) -> AsyncIterator[Pair]:
    pub = KVEventPublisher(
        "tcp://127.0.0.1:0", "tcp://127.0.0.1:0" if replay else None, encoding=encoding
    )
    pub.start()
    before(pub)
    context = zmq.asyncio.Context()
    index = KVIndex(10_000)
    sub = KVEventSubscriber(
        context, index, URL, pub.endpoint, pub.replay_endpoint, replay_timeout=0.5
    )
    task = asyncio.get_running_loop().create_task(sub.run())
    try:
        yield Pair(pub, sub, index)
    finally:
        await sub.aclose(task)
        context.term()
        await pub.aclose()


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_stored_and_removed_blocks_reach_the_index(encoding):
    async with pair(encoding) as p:
        await p.joined()
        p.store([11, 12, 13], None, 0)
        await until(lambda: p.depth() == 3)
        p.pub.publish([removed([12], encoding)])
        await until(lambda: p.depth() == 1)
        p.pub.publish([cleared(encoding)])
        await until(lambda: p.depth() == 0)
        assert p.sub.stats.malformed == 0


async def test_replay_on_connect_learns_what_the_engine_already_holds():
    def before(pub: KVEventPublisher) -> None:
        pub.publish([stored([1, 2], None, TOKENS[:32], 16, "map")])
        pub.publish([stored([3, 4], 2, TOKENS[32:64], 16, "map")])

    async with pair(before=before) as p:
        await p.sub.ready.wait()
        assert p.depth() == 4 and p.sub.sequence.next == 2


async def test_a_gap_is_filled_from_the_replay_socket():
    async with pair() as p:
        await p.joined()
        p.pub.faults.drop_batches = 2
        p.store([1], None, 0)
        p.store([2], 1, 1)  # both lost on the PUB socket
        p.store([3], 2, 2)
        await until(lambda: p.depth() == 3)
        assert p.sub.sequence.gaps == 1 and p.sub.stats.replays == 2


async def test_a_gap_without_replay_clears_and_rebuilds_from_what_is_heard():
    async with pair() as p:
        await p.joined()
        p.store([1, 2], None, 0)
        await until(lambda: p.depth() == 2)
        p.pub.faults.replay = False
        p.pub.faults.drop_batches = 1
        p.pub.publish([removed([2], "map")])  # lost, and never replayed
        p.store([9], None, 0)  # a new root block
        await until(lambda: p.sub.sequence.restarts == 1)
        # The stale blocks went with the rebuild; what was heard after the gap stays.
        assert p.depth() == 1 and len(p.index) == 1


async def test_an_engine_restart_clears_its_entries_and_relearns():
    async with pair() as p:
        await p.joined()
        p.store([1, 2, 3], None, 0)
        await until(lambda: p.depth() == 3)
        p.pub.restart_sequence()  # a new engine: numbers from 0, an empty cache
        await asyncio.sleep(0.02)  # its batches are stamped later than the last applied one
        p.store([51], None, 0)
        await until(lambda: p.sub.sequence.restarts == 1)
        await until(lambda: p.depth() == 1)
        p.store([52], 51, 1)
        await until(lambda: p.depth() == 2)


async def test_malformed_messages_are_counted_dropped_and_the_subscriber_goes_on():
    async with pair() as p:
        await p.joined()
        raw = p.pub._pub  # the PUB socket itself, to send what vLLM never would
        raw.send_multipart((b"", b"short", b"x"))
        raw.send_multipart((b"", (99).to_bytes(8, "big"), b"\xc1"))  # not msgpack
        raw.send_multipart((b"", (99).to_bytes(8, "big"), b"\x93\x01\x02\x03"))  # [1,2,3]
        raw.send_multipart((b"only one frame",))
        await until(lambda: p.sub.stats.malformed == 4)
        p.store([1], None, 0)
        await until(lambda: p.depth() == 1)


async def test_a_stopped_subscriber_takes_its_engines_entries_with_it():
    async with pair() as p:
        await p.joined()
        p.store([1], None, 0)
        await until(lambda: p.depth() == 1)
        index = p.index
    assert len(index) == 0


async def _endless_replays(router: zmq.asyncio.Socket, batch: bytes, trickle: float) -> None:
    """Answers every replay request with batches, numbered on, never the end."""
    while True:
        client, _, _start = await router.recv_multipart()
        for seq in itertools.count():
            await router.send_multipart((client, b"", b"", seq.to_bytes(8, "big"), batch))
            await asyncio.sleep(trickle)


@pytest.mark.parametrize("trickle", [0.0, 0.05], ids=["flood", "trickle"])
async def test_an_endless_replay_is_left_for_the_live_feed(trickle):
    """A replay socket that never sends the end (flooding, or a batch just inside each
    timeout): the subscriber leaves it after its bound, counts a failure and follows the
    live feed."""
    context = zmq.asyncio.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    replay = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    batch = msgpack.packb([1.0, [stored([7], None, TOKENS[:16], 16, "map")], 0])
    answering = asyncio.create_task(_endless_replays(router, batch, trickle))
    pub = KVEventPublisher("tcp://127.0.0.1:0")
    index = KVIndex(10_000)
    sub = KVEventSubscriber(context, index, URL, pub.endpoint, replay, replay_timeout=0.1)
    task = asyncio.get_running_loop().create_task(sub.run())
    try:
        await asyncio.wait_for(sub.ready.wait(), 5)  # the bound: 10 timeouts, 1 s
        assert sub.stats.replay_failures == 1
        p = Pair(pub, sub, index)
        await p.joined()
        p.store([1, 2], None, 0)
        await until(lambda: p.depth() == 2)
    finally:
        answering.cancel()
        await sub.aclose(task)
        router.close(0)
        await pub.aclose()
        context.term()


async def test_an_undecodable_batch_takes_its_number_and_wipes_nothing():
    # Issue 31: a batch with a valid sequence number and a payload that does not decode was
    # dropped without taking its number; the next batch then looked like a gap no replay
    # could fill, and the engine's whole index was wiped (36 -> 18 blocks in one measure).
    async with pair() as p:
        await p.joined()
        p.store([1, 2, 3], None, 0)
        await until(lambda: p.depth() == 3)
        bad = p.pub._seq
        p.pub._seq += 1  # numbered as the engine numbers it, never in its replay buffer
        p.pub._pub.send_multipart((b"", bad.to_bytes(8, "big"), b"\x93\x01\x02\x03"))
        await until(lambda: p.sub.stats.malformed == 1)
        p.store([4], 3, 3)
        await until(lambda: p.depth() == 4)
        assert p.sub.sequence.restarts == 0 and p.sub.sequence.gaps == 0
        assert len(p.index) == 4


async def test_five_thousand_bad_batches_log_a_few_lines(caplog):
    async with pair() as p:
        await p.joined()
        with caplog.at_level("DEBUG", logger="pdproxy.membership.kv_subscriber"):
            for i in range(5000):
                seq = p.pub._seq
                p.pub._seq += 1
                p.pub._pub.send_multipart((b"", seq.to_bytes(8, "big"), b"\xc1" * 39))
                if i % 500 == 0:
                    await asyncio.sleep(0)
            await until(lambda: p.sub.stats.malformed >= 4000, timeout=10)
        lines = [r for r in caplog.records if "kv_subscriber" in r.name]
        assert len(lines) <= 5, len(lines)  # was a whole traceback per batch
        assert all(r.exc_info is None for r in lines)
