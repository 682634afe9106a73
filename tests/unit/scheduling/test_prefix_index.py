import pytest

from pdproxy.scheduling.prefix_index import PrefixIndex


def test_match_gives_each_instance_its_leading_depth():
    index = PrefixIndex(100)
    index.insert((1, 2, 3), "a")
    index.insert((1, 2), "b")
    index.insert((1, 9), "c")
    index.insert((2, 3), "d")  # not a prefix of (1, 2, 3)
    assert index.match((1, 2, 3, 4)) == {"a": 3, "b": 2, "c": 1}
    assert index.match((5,)) == {}
    assert index.match(()) == {}


def test_lru_cap_is_hard_and_evicts_the_oldest():
    index = PrefixIndex(4)
    index.insert((1, 2), "a")
    index.insert((3, 4), "b")
    index.match((1,))  # a match is not a use: only routing decisions refresh
    index.insert((1, 2), "a")  # refreshed
    index.insert((5, 6), "c")
    assert len(index) == 4
    assert index.match((3, 4)) == {}  # the oldest went
    assert index.match((1, 2)) == {"a": 2}


def test_stays_under_its_cap_with_many_distinct_prompts():
    index = PrefixIndex(1000)
    for i in range(50_000):
        index.insert((i, i + 10**9), f"u{i % 4}")
        assert len(index) <= 1000
    assert len(index.instances()) == 4


def test_forget_clears_an_instance_and_reuses_its_bit():
    index = PrefixIndex(100)
    index.insert((1, 2), "a")
    index.insert((1,), "b")
    index.forget("a")
    assert index.match((1, 2)) == {"b": 1} and len(index) == 1
    index.insert((7,), "c")  # takes a's old bit: must not inherit a's entries
    assert index.match((1, 2)) == {"b": 1}
    assert index.match((7,)) == {"c": 1}
    index.forget("nobody")


def test_cap_must_be_positive():
    with pytest.raises(ValueError):
        PrefixIndex(0)


def test_remove_clears_one_instance_and_drops_emptied_entries():
    index = PrefixIndex(100)
    index.insert((1, 2, 3), "a")
    index.insert((1, 2), "b")
    index.remove((2, 3, 42), "a")
    index.remove((1,), "nobody")
    assert index.match((1, 2, 3)) == {"a": 1, "b": 2}
    index.remove((1, 2), "b")
    assert len(index) == 1 and index.match((1, 2)) == {"a": 1}
