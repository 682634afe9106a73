"""The KV-event index checks its predictions against the engines' reported hits."""

from pdproxy.scheduling.kv_events import KVIndex


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
