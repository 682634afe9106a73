"""vLLM's KV events decoded (both encodings) and the exact index built from them."""

import pytest

from engines.sim.kv_events import cleared, removed, stored
from pdproxy.scheduling.kv_events import (
    Cleared,
    KVIndex,
    MalformedEvents,
    Removed,
    Stored,
    decode_batch,
    decode_event,
    pieces,
)
from pdproxy.scheduling.kv_keys import block_keys

TOKENS = list(range(100, 164))  # 4 blocks of 16


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_both_encodings_decode_to_the_same_events(encoding):
    batch = [
        1.5,
        [
            stored([11, 12], None, TOKENS[:32], 16, encoding),
            removed([12], encoding),
            cleared(encoding),
        ],
        0,
    ]
    events, rank = decode_batch(batch)
    assert rank == 0
    assert events == [
        Stored((11, 12), None, TOKENS[:32], 16, None, "GPU"),
        Removed((12,), "GPU"),
        Cleared(),
    ]


def test_vllm_0_32_fields_unknown_fields_and_unknown_types_are_ignored():
    """As vLLM 0.32's msgspec encodes them (read from a real KVEventBatch)."""
    event = {
        "type": "BlockStored",
        "block_hashes": [2**63 + 5],
        "parent_block_hash": None,
        "token_ids": [1, 2],
        "block_size": 2,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [["salt"]],
        "group_idx": 0,
        "future_field": {"x": 1},
    }
    events, _ = decode_batch([1.0, [event, {"type": "BlockPinned", "block_hashes": [1]}], 0])
    assert events == [Stored((2**63 + 5,), None, [1, 2], 2, None, "GPU", ("salt",))]
    assert decode_event(["SomethingNew", 1, 2]) is None


def test_only_the_full_attention_group_is_indexed():
    sliding = {**stored([1], None, [1, 2], 2, "map"), "kv_cache_spec_kind": "sliding_window"}
    full = {**stored([1], None, [1, 2], 2, "map"), "kv_cache_spec_kind": "full_attention"}
    assert decode_event(sliding) is None
    assert isinstance(decode_event(full), Stored)


@pytest.mark.parametrize(
    "batch",
    [
        "nope",
        [1.0],
        [1.0, "events"],
        [1.0, [42]],
        [1.0, [{"type": "BlockStored", "block_hashes": "x"}]],
        [1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 16}]],
        [1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1, 2], "block_size": 0}]],
        [1.0, [{"type": "BlockRemoved", "block_hashes": [1.5]}]],
        [1.0, [{**stored([1], None, [1, 2], 2, "map"), "parent_block_hash": "p"}]],
    ],
)
def test_malformed_batches_raise(batch):
    with pytest.raises(MalformedEvents):
        decode_batch(batch)


def _store(index, url, hashes, parent, tokens, **kw):
    index.apply(url, decode_batch([0.0, [stored(hashes, parent, tokens, 16, "map", **kw)], 0])[0])


def test_index_keys_are_pdproxys_own_chain_of_token_ids_not_engine_hashes():
    index = KVIndex(1000)
    # Two engines hash the same blocks differently (per-process seeds): same keys here.
    _store(index, "a", [1, 2], None, TOKENS[:32])
    _store(index, "a", [3], 2, TOKENS[32:48])
    _store(index, "b", [901, 902], None, TOKENS[:32])
    assert index.block_size == 16
    assert index.match(block_keys(TOKENS, 16)) == {"a": 3, "b": 2}
    assert index.match(block_keys(TOKENS[:20], 16)) == {"a": 1, "b": 1}
    assert index.match(block_keys([7, *TOKENS[1:]], 16)) == {}


def test_lora_and_cache_salt_separate_identical_tokens():
    index = KVIndex(1000)
    _store(index, "a", [1], None, TOKENS[:16], lora_name="ada", extra_keys=[["ada", "s1"]])
    assert index.match(block_keys(TOKENS[:16], 16)) == {}
    assert index.match(block_keys(TOKENS[:16], 16, lora_name="ada", cache_salt="s1")) == {"a": 1}
    assert index.match(block_keys(TOKENS[:16], 16, lora_name="ada", cache_salt="s2")) == {}


def test_removals_use_the_engines_hashes_and_clear_drops_an_engine():
    index = KVIndex(1000)
    _store(index, "a", [1, 2, 3], None, TOKENS[:48])
    _store(index, "b", [1, 2, 3], None, TOKENS[:48])
    index.apply("a", [Removed((2,))])
    index.apply("a", [Removed((999,))])  # never stored: nothing
    assert index.match(block_keys(TOKENS, 16)) == {"a": 1, "b": 3}
    index.apply("b", [Cleared()])
    assert index.match(block_keys(TOKENS, 16)) == {"a": 1}


def test_a_block_whose_parent_was_never_seen_is_counted_not_guessed():
    index = KVIndex(1000)
    _store(index, "a", [5], 4, TOKENS[16:32])
    assert len(index) == 0 and index.unchained == 1


def test_memory_is_capped_in_blocks():
    index = KVIndex(8)
    for tenant in range(10):
        _store(index, "a", list(range(tenant * 10, tenant * 10 + 4)), None, [tenant] * 64)
    assert len(index) == 8
    assert len(index._keys["a"]) <= 8


def test_the_oldest_engine_hashes_are_forgotten_first():
    index = KVIndex(4)
    _store(index, "a", [1, 2, 3], None, TOKENS[:48])
    _store(index, "a", [4, 5], 3, TOKENS[48:64] + [9] * 16)
    assert index.held("a") == 4
    index.apply("a", [Removed((1,))])  # forgotten: a no-op
    assert index.held("a") == 4
    index.apply("a", [Removed((2,))])  # still known: removed
    assert index.held("a") == 3


def _events() -> list:
    """Every kind of event, the stored ones long: a chain of 10 blocks from the root, one
    of 5 continuing it, removals, a clear, and stores after it."""
    tokens = [t % 97 for t in range(10 * 16 + 5 * 16)]
    return [
        Stored(tuple(range(1, 11)), None, tokens[:160], 16, "ada", None, ("ada", "salt")),
        Stored(tuple(range(11, 16)), 10, tokens[160:], 16),
        Removed((3, 4, 5, 6, 7, 8, 9)),
        Stored((), None, [], 16),
        Cleared(),
        Stored(tuple(range(20, 27)), None, tokens[:112], 16),
        Removed((25, 26)),
    ]


@pytest.mark.parametrize("most", [1, 2, 3, 7, 1000])
def test_pieces_apply_to_the_same_index_as_the_whole(most):
    events = _events()
    whole, cut = KVIndex(1000), KVIndex(1000)
    whole.apply("a", events)
    runs = list(pieces(events, most))

    def units(run):  # a block, or a clear or an empty event: each is work (issue 29)
        return sum(
            1 if isinstance(e, Cleared) or not e.block_hashes else len(e.block_hashes) for e in run
        )

    for run in runs:
        assert units(run) <= most
        cut.apply("a", run)
    assert cut._keys == whole._keys
    assert cut.prefixes._entries == whole.prefixes._entries
    assert cut.unchained == whole.unchained == 0
    assert units(events) == 33  # 31 blocks stored or removed, and two clears
    assert len(runs) == -(-33 // most)  # packed greedily


def test_a_stored_part_chains_to_the_block_before_it():
    event = Stored((1, 2, 3), 0, list(range(48)), 16, "ada", "cpu", ("ada",))
    first, second = (run[0] for run in pieces([event], 2))
    assert first == Stored((1, 2), 0, list(range(32)), 16, "ada", "cpu", ("ada",))
    assert second == Stored((3,), 2, list(range(32, 48)), 16, "ada", "cpu", ("ada",))


def test_the_block_size_is_each_engines_own_and_an_odd_one_falls_back_alone():
    # Issue 29: the index's block size was global: one publisher's empty BlockStored with a
    # block size of 1e18 zeroed every engine's prediction and switched off the self-check.
    index = KVIndex(1000)
    for name in ("a", "b", "c"):
        index.follow(name)
    _store(index, "a", [1, 2], None, TOKENS[:32])
    _store(index, "b", [5, 6], None, TOKENS[:32])
    assert index.block_size == 16 and index.live == {"a", "b", "c"}
    hostile = [0.0, [stored([], None, [], 10**18, "map")], 0]
    with pytest.raises(MalformedEvents):
        decode_batch(hostile)  # past any block size vLLM has: the batch is malformed
    odd = decode_batch([0.0, [stored([7], None, TOKENS[:32], 32, "map")], 0])[0]
    index.apply("c", odd)  # c's own block size is 32: c alone is scored approximately
    assert index.block_size == 16 and index.live == {"a", "b"}
    assert index.match(block_keys(TOKENS, 16)) == {"a": 2, "b": 2}
    _store(index, "c", [8], None, TOKENS[:16])  # c restarted with the fleet's size
    assert index.live == {"a", "b", "c"} and index.held("c") == 1  # its 32-blocks went
