"""Executing a plan on one rank: the invariant checks, order restoration, dummy batches, and the
planning an engine used alone does (the same `plan_phase`, rows fixed on their ranks)."""

import numpy as np
import pytest
import torch

from ballast.balance import MicroBatchMode, MicroBatchPolicy, MiniBatchPlan
from ballast.engine.config import MicroBatchSpec
from ballast.engine.micro_batch import check_rank_plan, dummy_micro_batch, plan_rank_micro_batches, restore_order
from ballast.engine.padding import check_padded_layout
from testkit.engine import make_rl_batch

LENGTHS = np.array([5, 90, 12, 33, 7, 120, 64, 3])


def _plan(*ranks, budget=None):
    return MiniBatchPlan(tuple(tuple(np.asarray(mb, dtype=np.int64) for mb in rank) for rank in ranks), budget)


def test_spec_policy_carries_the_sp_budget_and_the_mode():
    assert MicroBatchSpec(micro_batch_size_per_gpu=2).policy(4) == MicroBatchPolicy(MicroBatchMode.STATIC, 2)
    dynamic = MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=60).policy(2)
    assert dynamic.mode is MicroBatchMode.DYNAMIC and dynamic.token_budget == 120
    bucketed = MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=60, bucket_boundaries=(8,)).policy(1)
    assert bucketed.mode is MicroBatchMode.BUCKETED and bucketed.bucket_boundaries == (8,)


@pytest.mark.parametrize("budget_per_gpu, sp", [(120, 1), (60, 2), (200, 1), (1000, 1)])
def test_a_rank_alone_plans_every_row_once_under_the_cap(budget_per_gpu, sp):
    spec = MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=budget_per_gpu)
    plan = plan_rank_micro_batches(LENGTHS, spec.policy(sp), dp_group=None)
    assert check_rank_plan(plan, 1, 0, LENGTHS) is None
    assert all(LENGTHS[m].sum() <= budget_per_gpu * sp for m in plan.for_rank(0))
    assert plan.num_micro_batches >= int(np.ceil(LENGTHS.sum() / (budget_per_gpu * sp)))


def test_sample_over_the_budget_is_a_clear_error():
    spec = MicroBatchSpec(use_dynamic_bsz=True, max_token_len_per_gpu=100)
    with pytest.raises(ValueError, match="120"):
        plan_rank_micro_batches(LENGTHS, spec.policy(1), dp_group=None)


def test_restore_gives_input_order():
    data = make_rl_batch([2, 4, 1, 3, 5, 2], [3, 1, 6, 2, 2, 4], vocab_size=40, seed=3)
    lengths = data["attention_mask"].sum(-1).numpy()
    policy = MicroBatchPolicy(MicroBatchMode.DYNAMIC, token_budget=int(lengths.max()))
    micro = plan_rank_micro_batches(lengths, policy, dp_group=None).for_rank(0)
    assert np.concatenate(micro).tolist() != list(range(6))  # really reordered
    restored = restore_order([data["input_ids"][torch.as_tensor(m)] for m in micro], micro)
    assert torch.equal(restored, data["input_ids"])


def test_restore_checks_row_counts():
    with pytest.raises(ValueError, match="plan covers 2 rows but outputs have 3"):
        restore_order([torch.zeros(3)], (np.array([1, 0]),))


def test_dummy_micro_batch_is_a_valid_two_token_row():
    dummy = dummy_micro_batch(seq_len=9, response_len=4, device=torch.device("cpu"))
    check_padded_layout(dummy["attention_mask"], 4)
    assert dummy["attention_mask"].sum() == 2 and dummy["response_mask"].sum() == 1
    assert dummy["position_ids"][0, 4:6].tolist() == [0, 1]


def test_plans_balance_the_workload_they_are_given():
    from ballast.balance import FlopsModel, workload_costs

    # one long sample among short ones: balanced by tokens it gets a short partner (1200 + 300 =
    # 1500 tokens, like the others); balanced by FLOPs it stays alone, because its attention cost
    # grows with the square of its length
    lengths = np.array([1200, 600, 600, 600, 600, 300, 300])
    flops = FlopsModel(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                       intermediate_size=11008, vocab_size=32000)
    policy = MicroBatchPolicy(MicroBatchMode.DYNAMIC, token_budget=1800)
    costs = workload_costs(lengths, flops)
    worst = {}
    for name, workload in (("tokens", "tokens"), ("flops", flops)):
        micro = plan_rank_micro_batches(lengths, policy, dp_group=None, workload=workload).for_rank(0)
        assert all(lengths[idx].sum() <= 2500 for idx in micro)
        worst[name] = max(costs[idx].sum() for idx in micro)
    assert worst["flops"] < worst["tokens"]


def test_check_rank_plan_names_every_defect():
    lengths = np.array([4, 6, 9])
    good = _plan([[2], [0, 1]], [[1, 0], [2]], budget=10)
    assert check_rank_plan(good, 2, 0, lengths) is None
    cases = {
        "3 ranks, the DP group has 2": _plan([[0, 1, 2]], [[0]], [[0]]),
        "unequal micro-batch counts per rank [1, 2]": _plan([[2], [0, 1]], [[0, 1, 2]]),
        "does not cover this rank's 3 rows exactly once": _plan([[2], [0, 0]], [[1, 0], [2]]),
        "micro-batch 0 of DP rank 0 holds 15 tokens, over the budget 10": _plan([[1, 2], [0]], [[1, 0], [2]], budget=10),
        "expected a MiniBatchPlan": [[[2], [0, 1]], [[1, 0], [2]]],
    }
    for message, bad in cases.items():
        error = check_rank_plan(bad, 2, 0, lengths)
        assert error is not None and message in error, (message, error)


def test_row_index_copies_read_only_plan_rows_without_warning():
    # A plan that came through Ray holds read-only arrays: selecting a micro-batch must neither warn
    # nor share memory with them.
    import warnings

    from ballast.engine.engine import row_index

    rows = np.array([3, 0, 2], dtype=np.int64)
    rows.flags.writeable = False
    data = make_rl_batch([2, 3, 4, 5], [1, 2, 3, 4], vocab_size=50)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        index = row_index(rows)
        micro = data[index]
    assert index.dtype == torch.int64 and index.tolist() == [3, 0, 2]
    assert torch.equal(micro["input_ids"], data["input_ids"][[3, 0, 2]])
    index[0] = 1
    assert rows[0] == 3
