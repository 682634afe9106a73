"""The KV-event index checks its predictions against the engines' reported hits."""

from engines.sim.kv_events import stored
from pdproxy.scheduling.kv_awaited import AwaitedStores
from pdproxy.scheduling.kv_events import KVIndex, decode_batch
from pdproxy.scheduling.kv_keys import block_keys


def test_wrong_predictions_in_a_row_distrust_an_engine_and_right_ones_restore_it(caplog):
    index = KVIndex(100)
    index.block_size = 16
    index.follow("a|0")
    for _ in range(4):
        index.verify("a|0", 0, 64)
    index.verify("a|0", 64, 64)  # one right: the row starts again
    for _ in range(4):
        index.verify("a|0", 0, 64)
    assert "a|0" in index.live
    version = index.live_version
    index.verify("a|0", 0, 64)
    assert "a|0" not in index.live and "a|0" in index.followed
    assert index.live_version > version
    assert "predicted 0 cached tokens where the engine found 64" in caplog.text
    for _ in range(4):
        index.verify("a|0", 48, 48)
    assert "a|0" not in index.live
    index.verify("a|0", 40, 48)  # under a block off: right (vLLM counts whole blocks)
    assert "a|0" in index.live
    figures = index.check.figures["a|0"]
    assert (figures.checked, figures.wrong, figures.distrusted) == (15, 9, False)


def test_an_engine_not_followed_is_not_checked_and_leaving_forgets_its_record():
    index = KVIndex(100)
    index.verify("x|0", 0, 64)
    assert "x|0" not in index.check.figures
    index.follow("a|0")
    for _ in range(5):
        index.verify("a|0", 0, 64)
    index.unfollow("a|0")
    index.follow("a|0")  # a new subscriber: a clean record
    assert "a|0" in index.live


def _stored(index: KVIndex, name: str, hashes: list[int], parent: int | None, tokens) -> None:
    event = stored(hashes, parent, tokens, 16, "map")
    index.apply(name, decode_batch([0.0, [event], 0])[0])


PROMPT = list(range(1000, 1064))  # four blocks of 16


def test_a_decodes_prediction_is_checked_by_the_first_block_it_stores():
    """vLLM reports a decode's cached tokens as the prefill's: its own hit is the first
    block of the prompt it stores (issue 29: a decode's publisher was never checked)."""
    index = KVIndex(1000)
    index.follow("d|0")
    _stored(index, "d|0", [1], None, PROMPT[:16])  # it holds the first block
    keys = block_keys(PROMPT, 16)
    index.await_stores("d|0", keys, 16, now=0.0)  # predicted right: one block
    _stored(index, "d|0", [2, 3, 4], 1, PROMPT[16:64])
    figures = index.check.figures["d|0"]
    assert (figures.checked, figures.wrong) == (1, 0)
    assert index.awaited.waiting("d|0") == 0
    # Its publisher said it held three blocks, but it stores from block 0, five times
    for _ in range(5):
        index.await_stores("d|0", keys, 48, now=1.0)
        _stored(index, "d|0", [11, 12, 13, 14], None, PROMPT)
    assert (figures.checked, figures.wrong) == (6, 5)
    assert "d|0" not in index.live  # scored approximately until it agrees again


def test_a_decode_that_stores_nothing_of_the_prompt_is_not_checked_and_legs_expire():
    index = KVIndex(1000)
    index.follow("d|0")
    index.await_stores("d|0", block_keys(PROMPT, 16), 0, now=0.0)
    _stored(index, "d|0", [7], None, list(range(16)))  # another prompt's block
    assert "d|0" not in index.check.figures
    index.sweep(now=100.0)
    assert index.awaited.waiting("d|0") == 0
    index.await_stores("x|0", block_keys(PROMPT, 16), 0, now=0.0)  # not followed
    assert index.awaited.waiting("x|0") == 0


def test_awaited_legs_are_bounded_oldest_first():
    awaited = AwaitedStores(max_keys=6)
    first, second, third = (tuple(range(n, n + 4)) for n in (0, 100, 200))
    awaited.add("d|0", first, 0, now=0.0)  # looks for block 0 only
    awaited.add("d|0", second, 2, now=0.0)  # blocks 0 to 2
    assert awaited.stored("d|0", [102, 103]) == (2, 2)  # right: its hit, two blocks
    assert awaited.stored("d|0", [102]) is None  # checked once
    awaited.add("d|0", third, 3, now=0.0)  # past 6 keys: the oldest go, to half the cap
    assert awaited.waiting("d|0") == 1
    assert awaited.stored("d|0", [0]) is None  # the first leg was dropped
    assert awaited.stored("d|0", [999, 202]) is None  # a chain never starts mid-prompt
    assert awaited.stored("d|0", [201, 202]) == (3, 1)  # a block or more over: wrong
    awaited.add("d|0", first, 0, now=0.0)
    awaited.sweep(now=31.0)
    assert awaited.waiting("d|0") == 0 and awaited.stored("d|0", [0]) is None


def test_a_long_prediction_looks_for_its_window_and_the_first_block():
    awaited = AwaitedStores()
    keys = tuple(range(1000, 1100))
    awaited.add("d|0", keys, 60, now=0.0)
    assert awaited.stored("d|0", [keys[30]]) is None  # before the window: not looked for
    assert awaited.stored("d|0", [keys[0]]) == (60, 0)  # the whole prompt: a lie
    awaited.add("d|0", keys, 60, now=0.0)
    assert awaited.stored("d|0", [keys[45], keys[46]]) == (60, 45)
    awaited.add("d|0", keys, 100, now=0.0)  # held the whole prompt: nothing to look for
    assert awaited.waiting("d|0") == 0
