"""Static and dynamic micro-batch plans: the hard token cap, every count from the minimum up to N,
the DP all-reduce-MAX protocol, ordering by cost, order restoration and the seed example."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ballast.balance import inverse_permutation, workload_costs
from ballast.balance.micro_batch import min_micro_batches, plan_dynamic_micro_batches, plan_static_micro_batches
from ballast.balance.partition import validate_partition

SETTINGS = settings(max_examples=60, deadline=None)


def test_seed_example_eight_samples_three_micro_batches():
    lengths = [800, 6500, 1200, 4000, 9000, 2500, 1500, 7500]
    assert min_micro_batches(lengths, 13312) == 3
    plan = plan_dynamic_micro_batches(lengths, 13312)
    sums = [sum(lengths[i] for i in mb) for mb in plan]
    assert len(plan) == 3 and max(sums) <= 13312
    assert max(sums) / min(sums) <= 1.08  # the seed's [11300, 11200, 10500]
    # Static path for comparison: 2 samples per micro-batch, no balance at all.
    static = [sum(lengths[i] for i in mb) for mb in plan_static_micro_batches(8, 2)]
    assert static == [7300, 5200, 11500, 9000]


def test_static_plan_and_divisibility_error():
    plan = plan_static_micro_batches(6, 3)
    assert [mb.tolist() for mb in plan] == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match=r"num_samples=10 .*micro_batch_size=4"):
        plan_static_micro_batches(10, 4)
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1"):
        plan_static_micro_batches(4, 0)


@st.composite
def rank_batches(draw, max_n=40):
    cap = draw(st.integers(1, 4096))
    lengths = draw(st.lists(st.integers(0, cap), min_size=1, max_size=max_n))
    return lengths, cap


@SETTINGS
@given(rank_batches(), st.data(), st.sampled_from(["tokens", "verl"]))
def test_every_count_from_minimum_to_n_succeeds_under_the_cap(batch, data, workload):
    lengths, cap = batch
    n = len(lengths)
    lower = min_micro_batches(lengths, cap)
    assert math.ceil(sum(lengths) / cap) <= lower <= n
    k = data.draw(st.integers(lower, n), label="k")
    plan = plan_dynamic_micro_batches(lengths, cap, num_micro_batches=k, workload=workload)
    validate_partition(plan, n, k=k, allow_empty=False)
    assert all(sum(lengths[i] for i in mb) <= cap for mb in plan)
    costs = workload_costs(lengths, workload)
    micro_costs = [costs[mb].sum() for mb in plan]
    assert micro_costs == sorted(micro_costs, reverse=True)
    restored = np.concatenate(plan)[inverse_permutation(np.concatenate(plan))]
    assert restored.tolist() == list(range(n))


@SETTINGS
@given(st.integers(1, 2000), st.lists(st.lists(st.integers(1, 2000), min_size=1, max_size=24), min_size=2, max_size=6))
def test_all_reduce_max_protocol_never_fails(cap, per_rank):
    """Engine protocol: k = MAX over ranks of min_micro_batches; every rank that has >= k samples
    must then plan exactly k micro-batches."""
    per_rank = [[min(x, cap) for x in lengths] for lengths in per_rank]
    k = max(min_micro_batches(lengths, cap) for lengths in per_rank)
    for lengths in per_rank:
        if len(lengths) >= k:
            plan = plan_dynamic_micro_batches(lengths, cap, num_micro_batches=k)
            assert len(plan) == k and all(sum(lengths[i] for i in mb) <= cap for mb in plan)


def test_balanced_by_workload_not_just_tokens():
    lengths = [6000, 6000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000, 1000]
    by_verl = plan_dynamic_micro_batches(lengths, 12000, num_micro_batches=2, workload="verl")
    costs = workload_costs(lengths, "verl")
    sums = [costs[mb].sum() for mb in by_verl]
    assert max(sums) / min(sums) < 1.01
    assert sorted(len(mb) for mb in by_verl) == [6, 6]  # one long + five short each


def test_single_sample_over_budget_names_index_length_and_budget():
    with pytest.raises(ValueError, match=r"sample 2 has 9000 tokens.*max_tokens=8192"):
        min_micro_batches([100, 200, 9000], 8192)
    with pytest.raises(ValueError, match=r"sample 0 has 9000 tokens.*max_tokens=8192"):
        plan_dynamic_micro_batches([9000], 8192)


def test_counts_outside_the_feasible_range_are_rejected():
    lengths = [5000, 5000, 5000]
    with pytest.raises(ValueError, match=r"num_micro_batches=2 is outside \[3, 3\]"):
        plan_dynamic_micro_batches(lengths, 8000, num_micro_batches=2)
    with pytest.raises(ValueError, match=r"num_micro_batches=5 is outside \[1, 3\]"):
        plan_dynamic_micro_batches([1, 2, 3], 8000, num_micro_batches=5)
    assert plan_dynamic_micro_batches([], 8000) == [] and min_micro_batches([], 10) == 0
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        min_micro_batches([1], 0)


def test_inverse_permutation():
    order = np.array([3, 0, 2, 1])
    inv = inverse_permutation(order)
    assert inv.tolist() == [1, 3, 2, 0]
    x = np.array([10, 11, 12, 13])
    assert x[order][inv].tolist() == x.tolist()
    with pytest.raises(ValueError, match="appears 2 times"):
        inverse_permutation([0, 0, 1])


def test_deterministic_plans():
    lengths = np.random.default_rng(5).integers(1, 50, 300) * 100  # many ties
    a = plan_dynamic_micro_batches(lengths, 16384, workload="verl")
    b = plan_dynamic_micro_batches(lengths.tolist(), 16384, workload="verl")
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
