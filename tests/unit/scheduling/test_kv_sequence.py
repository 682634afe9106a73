"""Sequence numbers of a KV event publisher: apply, gap, restart, replay overlap."""

from pdproxy.scheduling.kv_sequence import Action, SequenceTracker


def test_in_order_batches_apply_and_a_gap_asks_for_a_replay():
    t = SequenceTracker()
    assert [t.live(s, 1.0 + s) for s in (5, 6)] == [Action.APPLY, Action.APPLY]
    assert t.live(9, 10.0) is Action.REPLAY and t.next == 7
    assert [t.replayed(s, 1.0 + s) for s in (6, 7, 8, 9)] == [
        Action.SKIP,
        Action.APPLY,
        Action.APPLY,
        Action.APPLY,
    ]
    assert t.next == 10 and t.gaps == 1


def test_a_number_going_back_with_a_newer_timestamp_is_a_restart():
    t = SequenceTracker()
    t.live(0, 100.0)  # an engine that published once...
    assert t.live(0, 160.0) is Action.RESTART  # ...restarted: 0 again
    assert t.next is None and t.restarts == 1
    assert t.replayed(0, 160.0) is Action.APPLY


def test_a_batch_seen_through_the_replay_and_then_live_is_skipped():
    t = SequenceTracker()
    assert [t.replayed(s, float(s)) for s in (0, 1, 2)] == [Action.APPLY] * 3
    assert t.live(1, 1.0) is Action.SKIP and t.live(2, 2.0) is Action.SKIP
    assert t.live(3, 3.0) is Action.APPLY


def test_a_replay_that_cannot_cover_the_gap_rebuilds_from_what_it_has():
    t = SequenceTracker(next=4, last_ts=4.0)
    assert t.replayed(40, 40.0) is Action.RESTART
    assert t.next == 41 and t.restarts == 1
