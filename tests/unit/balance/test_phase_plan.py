"""`plan_phase`: the one plan of a phase, for every micro-batch mode, checked by its invariants."""

import numpy as np
import pytest

from ballast.balance import MicroBatchMode, MicroBatchPolicy, plan_phase
from ballast.balance.bucketing import bucket_ids

RNG = np.random.default_rng(7)
LENGTHS = RNG.integers(5, 200, size=48)
PROMPTS = np.minimum(LENGTHS - 1, RNG.integers(1, 80, size=48))
DYNAMIC = MicroBatchPolicy(MicroBatchMode.DYNAMIC, token_budget=400)
STATIC = MicroBatchPolicy(MicroBatchMode.STATIC, micro_batch_size=3)
BUCKETED = MicroBatchPolicy(MicroBatchMode.BUCKETED, token_budget=400, bucket_boundaries=(20, 50))


def _rank_micro_rows(plan, m, r):
    """Step rows of every micro-batch of rank r in mini-batch m."""
    part = plan.partitions(m)[r]
    return [part[mb] for mb in plan.mini_batches[m].for_rank(r)]


@pytest.mark.parametrize("policy", [DYNAMIC, STATIC, BUCKETED], ids=lambda p: p.mode.value)
@pytest.mark.parametrize("balance", [True, False])
@pytest.mark.parametrize("dp, mini, epochs", [(1, None, 1), (2, 24, 2), (4, 16, 1), (3, 12, 3)])
def test_every_row_once_per_epoch_equal_counts_under_the_cap(policy, balance, dp, mini, epochs):
    plan = plan_phase(LENGTHS, dp, policy, mini_batch_samples=mini, epochs=epochs, shuffle=True, seed=3,
                      balance=balance, prompt_lengths=PROMPTS)
    per_epoch = len(plan.mini_batches) // epochs
    assert len(plan.rows) == len(LENGTHS) * epochs and plan.dp_size == dp
    assert len(set(plan.rank_sizes())) == 1  # equal rows per rank: the contiguous split is the layout
    buckets = bucket_ids(PROMPTS, (20, 50))
    for e in range(epochs):
        seen = []
        for m in range(e * per_epoch, (e + 1) * per_epoch):
            counts = {len(plan.mini_batches[m].for_rank(r)) for r in range(dp)}
            assert len(counts) == 1  # lockstep: the same number of micro-batches on every rank
            for r in range(dp):
                for rows in _rank_micro_rows(plan, m, r):
                    assert len(rows) > 0
                    if policy.mode is MicroBatchMode.STATIC:
                        assert len(rows) <= policy.micro_batch_size
                    else:
                        assert LENGTHS[rows].sum() <= policy.token_budget
                    if policy.mode is MicroBatchMode.BUCKETED:
                        assert len(set(buckets[rows])) == 1
                    seen.extend(rows.tolist())
        assert sorted(seen) == list(range(len(LENGTHS)))


def test_groups_stay_on_one_rank_and_in_one_mini_batch():
    groups = np.repeat(np.arange(12), 4)
    plan = plan_phase(LENGTHS, 2, DYNAMIC, mini_batch_samples=16, epochs=2, shuffle=True, seed=1, group_ids=groups)
    for m in range(len(plan.mini_batches)):
        parts = plan.partitions(m)
        for g in range(12):
            holders = [r for r, p in enumerate(parts) if np.isin(np.flatnonzero(groups == g), p).any()]
            assert len(holders) <= 1
            if holders:
                assert np.isin(np.flatnonzero(groups == g), parts[holders[0]]).all()


def test_deterministic_for_a_seed_and_reshuffled_per_epoch():
    a = plan_phase(LENGTHS, 2, STATIC, mini_batch_samples=12, epochs=2, shuffle=True, seed=[5, 1, 0])
    b = plan_phase(LENGTHS, 2, STATIC, mini_batch_samples=12, epochs=2, shuffle=True, seed=[5, 1, 0])
    assert np.array_equal(a.rows, b.rows)
    # mini-batch 0 of epoch 0 and mini-batch 0 of epoch 1 (index 4) hold different rows
    assert not np.array_equal(a.first_mini_batch_rows(), np.sort(np.concatenate(a.partitions(4))))


def test_balancing_evens_the_ranks_tokens():
    skewed = np.concatenate([np.full(8, 190), np.full(8, 10)])
    raw = plan_phase(skewed, 2, STATIC, balance=False)
    balanced = plan_phase(skewed, 2, STATIC, balance=True)
    spread = lambda plan: np.ptp([skewed[p].sum() for p in plan.partitions(0)])
    assert spread(raw) == 8 * 180 and spread(balanced) == 0


def test_first_mini_batch_rows_and_restore_index():
    plan = plan_phase(LENGTHS, 2, DYNAMIC, mini_batch_samples=16, shuffle=True, seed=0)
    first = plan.first_mini_batch_rows()
    assert len(first) == 16 and set(first) == set(np.concatenate(plan.partitions(0)))
    one = plan_phase(LENGTHS, 4, DYNAMIC)
    values = LENGTHS[one.rows]  # what ranks return, in dispatch order
    assert np.array_equal(values[one.restore_index()], LENGTHS)


def test_fixed_partitions_pad_a_short_rank_with_empty_micro_batches():
    parts = [np.arange(0, 7), np.arange(7, 9)]  # an engine used alone: uneven rows per rank
    plan = plan_phase(np.array([100, 100, 100, 100, 100, 100, 100, 10, 10]), 2,
                      MicroBatchPolicy(MicroBatchMode.DYNAMIC, token_budget=200), partitions=parts)
    mini = plan.mini_batches[0]
    assert mini.rows_per_rank == (7, 2)
    assert len(mini.for_rank(0)) == len(mini.for_rank(1)) == 4
    assert sum(1 for mb in mini.for_rank(1) if len(mb) == 0) == 2  # 2 rows: 2 real, 2 zero-weight


@pytest.mark.parametrize("kwargs, message", [
    (dict(mini_batch_samples=10), "do not split into mini-batches"),
    (dict(partitions=[np.arange(48)]), "fixed partition"),
])
def test_impossible_requests_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_phase(LENGTHS, 4, DYNAMIC, **kwargs)


def test_policy_checks_its_fields():
    with pytest.raises(ValueError, match="micro_batch_size"):
        MicroBatchPolicy(MicroBatchMode.STATIC)
    with pytest.raises(ValueError, match="token_budget"):
        MicroBatchPolicy(MicroBatchMode.DYNAMIC)
    with pytest.raises(ValueError, match="bucket_boundaries"):
        MicroBatchPolicy(MicroBatchMode.DYNAMIC, token_budget=10, bucket_boundaries=(4,))


def test_a_sample_over_the_budget_is_a_clear_error():
    with pytest.raises(ValueError, match="199|budget|max_tokens"):
        plan_phase(np.array([199, 5, 5, 5]), 2, MicroBatchPolicy(MicroBatchMode.DYNAMIC, token_budget=100))
