"""DP balance: equal counts, the driver's reorder-then-chunk contract, verl-named metrics, uid groups."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ballast.balance import FlopsModel, workload_costs
from ballast.balance.dp_balance import balance_batch
from ballast.balance.partition import validate_partition

# Seed example (000): 16 samples over 4 ranks; contiguous chunks sum to 21500 / 11800 / 16000 / 15300.
SIXTEEN = [8000, 6500, 4200, 2800, 3000, 2500, 3500, 2800, 5000, 4000, 3800, 3200, 6000, 3900, 2900, 2500]


def test_sixteen_samples_over_four_ranks():
    plan = balance_batch(SIXTEEN, 4)
    m = plan.metrics
    assert (m["global_seqlen/max"], m["global_seqlen/min"], m["global_seqlen/minmax_diff"]) == (21500, 11800, 9700)
    assert m["global_seqlen/mean"] == pytest.approx(sum(SIXTEEN) / 4)
    assert m["global_seqlen/imbalance"] == pytest.approx(21500 / 16150)
    # The seed shows 17300 / 15800 after verl's KK (ratio 1.09); ours must be at least that good.
    assert m["global_seqlen/balanced_max"] / m["global_seqlen/balanced_min"] <= 1.09
    assert m["global_seqlen/balanced_max"] - m["global_seqlen/balanced_min"] <= 9700 / 5
    sums = [sum(SIXTEEN[i] for i in p) for p in plan.partitions]
    assert (max(sums), min(sums)) == (m["global_seqlen/balanced_max"], m["global_seqlen/balanced_min"])


@st.composite
def batches(draw):
    dp = draw(st.integers(1, 8))
    n = dp * draw(st.integers(1, 10))
    return draw(st.lists(st.integers(1, 20_000), min_size=n, max_size=n)), dp


@settings(max_examples=50, deadline=None)
@given(batches(), st.sampled_from(["tokens", "verl", "flops"]))
def test_order_chunks_into_the_partitions(batch, workload):
    lengths, dp = batch
    model = FlopsModel(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                       vocab_size=100) if workload == "flops" else workload
    plan = balance_batch(lengths, dp, workload=model)
    n = len(lengths)
    assert sorted(plan.order.tolist()) == list(range(n))
    validate_partition(plan.partitions, n, k=dp, equal_size=True)
    for rank, chunk in enumerate(np.split(plan.order, dp)):  # what a DP dispatch does after reordering
        assert chunk.tolist() == plan.partitions[rank].tolist()
    costs = workload_costs(lengths, model)
    balanced = max(costs[p].sum() for p in plan.partitions)
    assert plan.metrics["global_workload/balanced_max"] == pytest.approx(balanced)
    assert balanced <= plan.metrics["global_workload/max"] * (1 + 1e-12)  # never worse than no balancing
    assert balanced <= costs.sum() / dp + costs.max() * (1 + 1e-9)  # within one item of perfect


def test_groups_stay_on_one_rank_with_equal_counts():
    rng = np.random.default_rng(3)
    uids = np.repeat([f"prompt-{i}" for i in range(16)], 4)
    rng.shuffle(uids)  # samples of one uid need not be contiguous
    lengths = rng.integers(100, 5000, len(uids))
    plan = balance_batch(lengths, 4, workload="verl", group_ids=uids)
    validate_partition(plan.partitions, len(uids), k=4, equal_size=True)
    for part in plan.partitions:
        assert len(part) == 16
        for uid in set(uids[part]):
            assert set(np.flatnonzero(uids == uid)) <= set(part.tolist())


def test_unequal_groups_exact_fill_and_impossible_cases():
    # sizes 3,3,2,2,2 onto 2 ranks of 6: only {3,3} + {2,2,2} works (greedy by load would miss it)
    ids = [0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 4, 4]
    lengths = [100, 100, 100, 90, 90, 90, 500, 500, 10, 10, 20, 20]
    plan = balance_batch(lengths, 2, group_ids=ids)
    assert sorted(sorted(np.asarray(ids)[p].tolist()) for p in plan.partitions) == [
        [0, 0, 0, 1, 1, 1], [2, 2, 3, 3, 4, 4]]
    with pytest.raises(ValueError, match=r"3 group\(s\) of 3, 1 group\(s\) of 1\) .*dp_size=2 .*exactly 5"):
        balance_batch([1] * 10, 2, group_ids=[0, 0, 0, 1, 1, 1, 2, 2, 2, 3])
    with pytest.raises(ValueError, match=r"1 group\(s\) of 4"):
        balance_batch([1] * 4, 2, group_ids=[7, 7, 7, 7])


def test_bad_sizes_name_the_numbers():
    with pytest.raises(ValueError, match=r"N=10 .*dp_size=4"):
        balance_batch(list(range(1, 11)), 4)
    with pytest.raises(ValueError, match="dp_size"):
        balance_batch([1, 2], 0)
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        balance_batch([1, 2], 2, group_ids=[1, 2, 3])


def test_deterministic():
    lengths = np.random.default_rng(0).integers(1, 300, 256)  # many equal lengths
    a, b = balance_batch(lengths, 8, "verl"), balance_batch(lengths.tolist(), 8, "verl")
    assert a.order.tolist() == b.order.tolist() and a.metrics == b.metrics
