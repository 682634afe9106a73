import pytest

from pdproxy.errors import NoEndpointAvailable
from pdproxy.scheduling.context import RequestFeatures
from pdproxy.types import DecodeOnly, PairDecision, Role, Snapshot
from tests.unit.scheduling.helpers import endpoint, fleet, scheduler, with_load


def test_pairs_by_default_and_503_without_a_decode():
    s = scheduler()
    assert isinstance(s.schedule(RequestFeatures(tokens=10), fleet(2, 2)), PairDecision)
    with pytest.raises(NoEndpointAvailable, match="decode"):
        s.schedule(RequestFeatures(), fleet(1, 0))


def test_no_prefill_is_503_unless_decode_only_fallback():
    with pytest.raises(NoEndpointAvailable, match="prefill"):
        scheduler().schedule(RequestFeatures(), fleet(0, 2))
    decision = scheduler(decode_only_fallback=True).schedule(RequestFeatures(), fleet(0, 2))
    assert isinstance(decision, DecodeOnly) and decision.reason == "no_prefill"


@pytest.mark.parametrize(("tokens", "pd"), [(255.9, False), (256, True), (5000, True)])
def test_threshold_sends_short_prompts_to_a_decode_alone(tokens, pd):
    s = scheduler(pd_threshold_tokens=256)
    decision = s.schedule(RequestFeatures(tokens=tokens), fleet(2, 2))
    assert isinstance(decision, PairDecision) is pd
    if not pd:
        assert isinstance(decision, DecodeOnly) and decision.reason == "short_prompt"


def test_threshold_counts_a_prefix_hit_on_a_prefill_as_cached():
    s = scheduler(pd_threshold_tokens=256, prefill_policy="prefix-affinity")
    snapshot = fleet(2, 2)
    blocks = tuple(range(10))
    first = s.schedule(RequestFeatures(tokens=400, blocks=blocks), snapshot)
    assert isinstance(first, PairDecision)
    # 9 of its 10 blocks are cached on a prefill: ~40 uncached tokens left, under 256.
    second = s.schedule(RequestFeatures(tokens=400, blocks=(*blocks[:9], 99)), snapshot)
    assert isinstance(second, DecodeOnly)


def test_prefill_dp_ranks_balance_by_legs_in_flight():
    s = scheduler(prefill_policy="round-robin")
    p = endpoint("http://p:1", Role.PREFILL, dp=4)
    snapshot = Snapshot((p,), (endpoint("http://d:1"),))
    ranks = [s.schedule(RequestFeatures(), snapshot).prefill_dp_rank for _ in range(4)]
    assert ranks == [0, 1, 2, 3]
    p.legs.rank_in_flight = [3, 0, 2, 1]
    assert s.schedule(RequestFeatures(), snapshot).prefill_dp_rank == 1
    with_load(p, ranks=[(0, 0, 0, 0), (1, 9, 0, 0), (2, 0, 0, 0), (3, 0, 0, 0)])
    assert s.schedule(RequestFeatures(), snapshot).prefill_dp_rank == 3  # rank 1 busy on P


def test_decode_dp_rank_is_chosen_too():
    s = scheduler()
    d = endpoint("http://d:1", dp=2)
    d.legs.rank_in_flight = [1, 0]
    decision = s.schedule(
        RequestFeatures(), Snapshot((endpoint("http://p:1", Role.PREFILL),), (d,))
    )
    assert isinstance(decision, PairDecision) and decision.decode_dp_rank == 1


def test_retry_pick_uses_the_role_policy_and_empty_is_503():
    s = scheduler(decode_policy="least-loaded")
    a, b = endpoint("http://a:1", in_flight=4), endpoint("http://b:1")
    assert s.pick(Role.DECODE, RequestFeatures(), [a, b]) == (b, None)
    with pytest.raises(NoEndpointAvailable):
        s.pick(Role.DECODE, RequestFeatures(), [])


def test_forget_drops_a_departed_instance_from_the_indexes():
    s = scheduler(prefill_policy="prefix-affinity", decode_policy="prefix-affinity")
    s.schedule(RequestFeatures(blocks=(1, 2)), fleet(1, 1))
    assert s.prefill.index is not None and s.prefill.index.instances() == ["http://p0:1"]
    s.forget("http://p0:1")
    assert s.prefill.index.instances() == []


@pytest.mark.parametrize("prefills", [0, 2])
def test_a_request_vllm_cannot_split_goes_to_a_decode_alone(prefills):
    """Even with no prefill and no fallback: it never needed one."""
    features = RequestFeatures(tokens=5000, one_leg="parallel_sampling")
    decision = scheduler().schedule(features, fleet(prefills, 2))
    assert isinstance(decision, DecodeOnly) and decision.reason == "parallel_sampling"


def test_a_request_vllm_cannot_split_is_400_where_no_decode_may_serve_alone():
    from pdproxy.errors import BadRequest

    s = scheduler()
    s._decode_alone = False
    with pytest.raises(BadRequest, match="cannot serve parallel sampling"):
        s.schedule(RequestFeatures(one_leg="parallel_sampling"), fleet(2, 2))


def test_a_model_policy_overrides_the_fleets_for_that_model_only():
    s = scheduler(
        prefill_policy="round-robin",
        decode_policy="round-robin",
        model_policies=(("sticky", "consistent_hash", "consistent-hash"),),
    )
    snapshot = fleet(4, 4)
    sticky = RequestFeatures(model="sticky", session="user-7")
    assert len({s.schedule(sticky, snapshot).decode.url for _ in range(8)}) == 1
    other = RequestFeatures(model="other", session="user-7")
    assert len({s.schedule(other, snapshot).decode.url for _ in range(8)}) == 4
    assert s.pick(Role.DECODE, sticky, snapshot.decode)[0] is s.schedule(sticky, snapshot).decode
