"""Joint whole-step plans: equal counts on every rank, the cap, the lockstep cost model, and the
cross-rank refinement that may only lower it."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ballast.balance import (
    balance_batch,
    lockstep_cost,
    min_micro_batches,
    plan_dynamic_micro_batches,
    plan_joint_micro_batches,
    validate_partition,
    workload_costs,
)
from ballast.balance.joint import refine_lockstep


def test_lockstep_cost_model():
    assert lockstep_cost([[5, 3, 1], [4, 4, 2]]) == 5 + 4 + 2
    assert lockstep_cost([[5, 3, 1], [4, 4, 2]], fixed_cost_per_step=0.5) == 11 + 1.5
    assert lockstep_cost([[], []]) == 0.0
    with pytest.raises(ValueError, match=r"different micro-batch counts \[2, 3\]"):
        lockstep_cost([[1, 2], [1, 2, 3]])


@st.composite
def steps(draw):
    cap = draw(st.integers(50, 3000))
    dp = draw(st.integers(1, 5))
    n = draw(st.integers(1, 20))
    per_rank = [draw(st.lists(st.integers(1, cap), min_size=n, max_size=n)) for _ in range(dp)]
    return per_rank, cap


@settings(max_examples=40, deadline=None)
@given(steps(), st.sampled_from(["tokens", "verl"]))
def test_joint_plan_equal_counts_cap_and_coverage(step, workload):
    per_rank, cap = step
    needed = max(min_micro_batches(lengths, cap) for lengths in per_rank)
    if needed > min(len(lengths) for lengths in per_rank):
        with pytest.raises(ValueError, match="micro-batches may not be empty"):
            plan_joint_micro_batches(per_rank, cap, workload=workload)
        return
    plan = plan_joint_micro_batches(per_rank, cap, workload=workload)
    assert len({len(rank) for rank in plan}) == 1 and len(plan[0]) == needed
    for lengths, rank in zip(per_rank, plan):
        validate_partition(rank, len(lengths), k=needed, allow_empty=False)
        assert all(sum(lengths[i] for i in mb) <= cap for mb in rank)
    # The cross-rank refinement only ever lowers the lockstep cost of independent per-rank plans.
    costs = [workload_costs(lengths, workload) for lengths in per_rank]
    independent = [plan_dynamic_micro_batches(lengths, cap, needed, workload) for lengths in per_rank]
    joint_cost = lockstep_cost([[c[mb].sum() for mb in rank] for c, rank in zip(costs, plan)])
    indep_cost = lockstep_cost([[c[mb].sum() for mb in rank] for c, rank in zip(costs, independent)])
    assert joint_cost <= indep_cost * (1 + 1e-12)
    assert joint_cost >= sum(c.sum() for c in costs) / len(costs) * (1 - 1e-12)  # the lower bound


@settings(max_examples=40, deadline=None)
@given(steps(), st.integers(0, 2**31 - 1))
def test_refine_lockstep_never_increases_cost_from_any_start(step, seed):
    per_rank, cap = step
    rng = np.random.default_rng(seed)
    k = max(min_micro_batches(lengths, cap) for lengths in per_rank)
    if k > min(len(lengths) for lengths in per_rank):
        return
    start = [plan_dynamic_micro_batches(lengths, cap, k) for lengths in per_rank]
    start = [[rank[j] for j in rng.permutation(k)] for rank in start]  # misaligned steps on purpose
    tokens = [np.asarray(lengths, dtype=np.int64) for lengths in per_rank]
    costs = [t.astype(float) ** 2 for t in tokens]
    refined = refine_lockstep(costs, tokens, start, cap)
    before = lockstep_cost([[c[mb].sum() for mb in rank] for c, rank in zip(costs, start)])
    after = lockstep_cost([[c[mb].sum() for mb in rank] for c, rank in zip(costs, refined)])
    assert after <= before * (1 + 1e-12)
    for t, rank in zip(tokens, refined):
        validate_partition(rank, len(t), k=k, allow_empty=False)
        assert all(t[mb].sum() <= cap for mb in rank)


def test_whole_step_near_the_lower_bound_and_steps_in_decreasing_order():
    rng = np.random.default_rng(11)
    lengths = rng.integers(256, 8192, 512)
    dp, cap = 8, 16384
    dp_plan = balance_batch(lengths, dp, workload="verl")
    per_rank = [lengths[p] for p in dp_plan.partitions]
    plan = plan_joint_micro_batches(per_rank, cap, workload="verl")
    costs = [workload_costs(x, "verl") for x in per_rank]
    matrix = np.array([[c[mb].sum() for mb in rank] for c, rank in zip(costs, plan)])
    lower_bound = sum(c.sum() for c in costs) / dp
    assert lockstep_cost(matrix) / lower_bound < 1.01
    step_max = matrix.max(axis=0)
    assert (np.diff(step_max) <= 0).all()
    # j-th micro-batches of all ranks are of similar cost: every cell within 5% of its step's max.
    assert (matrix >= 0.95 * step_max[None, :]).all()


def test_joint_errors():
    with pytest.raises(ValueError, match="at least one rank"):
        plan_joint_micro_batches([], 100)
    with pytest.raises(ValueError, match=r"sample 1 has 200 tokens.*max_tokens=100"):
        plan_joint_micro_batches([[10, 200]], 100)
    with pytest.raises(ValueError, match=r"rank 1 has only 1 samples"):
        plan_joint_micro_batches([[90, 90], [10]], 100)
    with pytest.raises(ValueError, match="num_micro_batches=1 is below"):
        plan_joint_micro_batches([[90, 90], [10, 10]], 100, num_micro_batches=1)
    plan = plan_joint_micro_batches([[90, 90, 5], [10, 10, 10]], 100, num_micro_batches=3)
    assert [len(rank) for rank in plan] == [3, 3]
