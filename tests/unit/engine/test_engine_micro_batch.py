"""Micro-batch planning on one rank: coverage, token cap, order restoration, dummy batches."""

import numpy as np
import pytest
import torch

from ballast.engine.config import MicroBatchSpec
from ballast.engine.micro_batch import (
    MicroBatchPlan,
    dummy_micro_batch,
    plan_micro_batches,
    restore_order,
    split_micro_batches,
)
from ballast.engine.padding import check_padded_layout
from testkit.engine import make_rl_batch

LENGTHS = np.array([5, 90, 12, 33, 7, 120, 64, 3])


def test_static_plan_is_consecutive_chunks():
    plan = plan_micro_batches(LENGTHS, MicroBatchSpec(micro_batch_size_per_gpu=2), sp_size=1, dp_group=None)
    assert [m.tolist() for m in plan.micro_indices] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan.num_dummy == 0 and plan.num_micro_batches == 4


@pytest.mark.parametrize("budget_per_gpu, sp", [(120, 1), (60, 2), (200, 1), (1000, 1)])
def test_dynamic_plan_covers_every_row_once_under_the_cap(budget_per_gpu, sp):
    spec = MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=budget_per_gpu)
    plan = plan_micro_batches(LENGTHS, spec, sp_size=sp, dp_group=None)
    flat = np.concatenate(plan.micro_indices)
    assert sorted(flat.tolist()) == list(range(len(LENGTHS)))
    assert all(LENGTHS[m].sum() <= budget_per_gpu * sp for m in plan.micro_indices)
    assert all(len(m) > 0 for m in plan.micro_indices)
    assert plan.num_micro_batches >= int(np.ceil(LENGTHS.sum() / (budget_per_gpu * sp)))


def test_sample_over_the_budget_is_a_clear_error():
    spec = MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=100)
    with pytest.raises(ValueError, match="micro-batch planning failed .*120"):
        plan_micro_batches(LENGTHS, spec, sp_size=1, dp_group=None)


def test_indivisible_static_split_is_a_clear_error():
    with pytest.raises(ValueError, match="num_samples=8 is not divisible by micro_batch_size=3"):
        plan_micro_batches(LENGTHS, MicroBatchSpec(micro_batch_size_per_gpu=3), sp_size=1, dp_group=None)


def test_split_then_restore_gives_input_order():
    data = make_rl_batch([2, 4, 1, 3, 5, 2], [3, 1, 6, 2, 2, 4], vocab_size=40, seed=3)
    lengths = data["attention_mask"].sum(-1).numpy()
    spec = MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=int(lengths.max()))
    plan = plan_micro_batches(lengths, spec, sp_size=1, dp_group=None)
    assert np.concatenate(plan.micro_indices).tolist() != list(range(6))  # really reordered
    micros = split_micro_batches(data, plan)
    restored = restore_order([m["input_ids"] for m in micros], plan)
    assert torch.equal(restored, data["input_ids"])


def test_restore_checks_row_counts():
    plan = MicroBatchPlan(micro_indices=[np.array([1, 0])], num_dummy=0)
    with pytest.raises(ValueError, match="plan covers 2 rows but outputs have 3"):
        restore_order([torch.zeros(3)], plan)


def test_dummy_micro_batch_is_a_valid_two_token_row():
    dummy = dummy_micro_batch(seq_len=9, response_len=4, device=torch.device("cpu"))
    check_padded_layout(dummy["attention_mask"], 4)
    assert dummy["attention_mask"].sum() == 2 and dummy["response_mask"].sum() == 1
    assert dummy["position_ids"][0, 4:6].tolist() == [0, 1]


def test_dynamic_plans_balance_the_workload_they_are_given():
    from ballast.balance import FlopsModel, workload_costs
    from ballast.engine.config import MicroBatchSpec
    from ballast.engine.micro_batch import plan_micro_batches

    # one long sample among short ones: balanced by tokens it gets a short partner (1200 + 300 =
    # 1500 tokens, like the others); balanced by FLOPs it stays alone, because its attention cost
    # grows with the square of its length
    lengths = np.array([1200, 600, 600, 600, 600, 300, 300])
    flops = FlopsModel(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                       intermediate_size=11008, vocab_size=32000)
    spec = MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=1800)
    costs = workload_costs(lengths, flops)
    worst = {}
    for name, workload in (("tokens", "tokens"), ("flops", flops)):
        plan = plan_micro_batches(lengths, spec, sp_size=1, dp_group=None, workload=workload)
        assert all(lengths[idx].sum() <= 2500 for idx in plan.micro_indices)
        worst[name] = max(costs[idx].sum() for idx in plan.micro_indices)
    assert worst["flops"] < worst["tokens"]


def test_explicit_plan_gives_this_ranks_part_and_names_every_defect():
    from ballast.engine.micro_batch import explicit_plan

    spec = MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=10)
    lengths = np.array([4, 6, 9])
    plan = [[[2], [0, 1]], [[1, 0], [2]]]
    got, error = explicit_plan(plan, spec, 1, 2, 0, lengths)
    assert error is None and got.num_dummy == 0
    assert [m.tolist() for m in got.micro_indices] == [[2], [0, 1]]
    assert got.restore_index().tolist() == [1, 2, 0]
    cases = {
        "3 ranks, the DP group has 2": [[[0, 1, 2]], [[0]], [[0]]],
        "unequal micro-batch counts per rank [2, 1]": [[[2], [0, 1]], [[0, 1, 2]]],
        "rank 1's row indices are not each of 0..2 exactly once": [[[2], [0, 1]], [[1, 1], [2]]],
        "rank 0 covers 2 rows but holds 3": [[[2], [0]], [[1, 0], [2]]],
        "rank 0 has an empty micro-batch": [[[], [0, 1, 2]], [[1], [0]]],
        "micro-batch 0 holds 15 tokens, over the budget 10": [[[1, 2], [0]], [[1, 0], [2]]],
    }
    for message, bad in cases.items():
        got, error = explicit_plan(bad, spec, 1, 2, 0, lengths)
        assert got is None and message in error, (message, error)
    bucketed = MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=10, bucket_boundaries=(4,))
    assert "bucketing" in explicit_plan(plan, bucketed, 1, 2, 0, lengths)[1]
