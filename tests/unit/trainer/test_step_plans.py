"""The driver's central update plan: layout of the dispatched rows, one plan per (epoch, mini-batch),
groups kept, determinism."""

import numpy as np
import pytest

from ballast.trainer.step_plans import plan_update


def _rank_chunks(plan, dp):
    return np.split(plan.rows, dp)


@pytest.mark.parametrize("keep_groups", [False, True])
def test_every_epoch_covers_each_sample_once_and_plans_match_the_layout(keep_groups):
    rng = np.random.default_rng(0)
    n, dp, mini, epochs, cap = 48, 4, 16, 2, 600
    lengths = rng.integers(10, 300, n)
    uids = np.repeat(np.arange(n // 4), 4)
    plan = plan_update(lengths, dp, mini, cap, epochs, shuffle=True, seed=[1, 2], workload="verl",
                       group_ids=uids if keep_groups else None)
    assert len(plan.plans) == epochs * n // mini and len(plan.rows) == n * epochs
    per_rank = mini // dp
    chunks = _rank_chunks(plan, dp)
    epoch_rows = [[] for _ in range(epochs)]
    for m, central in enumerate(plan.plans):
        assert len(central) == dp and len({len(rank) for rank in central}) == 1
        for r in range(dp):
            rows = chunks[r][m * per_rank:(m + 1) * per_rank]
            epoch_rows[m // (n // mini)].extend(rows.tolist())
            assert sorted(np.concatenate(central[r]).tolist()) == list(range(per_rank))
            assert all(lengths[rows[mb]].sum() <= cap for mb in central[r])
        if keep_groups:
            for r in range(dp):
                rows = chunks[r][m * per_rank:(m + 1) * per_rank]
                for uid in np.unique(uids[rows]):
                    assert np.isin(np.flatnonzero(uids == uid), rows).all()
    for rows in epoch_rows:
        assert sorted(rows) == list(range(n))
    first_mb = [np.concatenate([chunks[r][:per_rank] for r in range(dp)])]
    second_epoch = [np.concatenate([chunks[r][(n // mini) * per_rank:(n // mini + 1) * per_rank] for r in range(dp)])]
    assert set(first_mb[0].tolist()) != set(second_epoch[0].tolist()), "each epoch reshuffles"
    again = plan_update(lengths, dp, mini, cap, epochs, shuffle=True, seed=[1, 2], workload="verl",
                        group_ids=uids if keep_groups else None)
    assert np.array_equal(again.rows, plan.rows)
    assert 1.0 <= plan.metrics["plan/lockstep_over_lower_bound"]


def test_without_shuffle_mini_batches_are_consecutive_samples():
    lengths = np.arange(1, 9) * 10
    plan = plan_update(lengths, 2, 4, 100, 1, shuffle=False, seed=0)
    chunks = _rank_chunks(plan, 2)
    assert sorted(np.concatenate([chunks[0][:2], chunks[1][:2]]).tolist()) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="not a multiple of the mini-batch size 3"):
        plan_update(lengths, 2, 3, 100, 1, shuffle=False, seed=0)


def test_groups_scattered_in_the_batch_are_not_split_by_mini_batch_cuts():
    # after the step-level reorder a group's samples need not be adjacent
    uids = np.array([0, 1, 1, 2, 0, 2, 3, 3])
    lengths = np.array([10, 20, 30, 40, 50, 60, 70, 80])
    plan = plan_update(lengths, 2, 4, 200, 1, shuffle=False, seed=0, group_ids=uids)
    chunks = _rank_chunks(plan, 2)
    for m in range(2):
        rows = np.concatenate([chunks[r][m * 2:(m + 1) * 2] for r in range(2)])
        assert sorted(set(uids[rows].tolist())) in ([0, 1], [2, 3])  # whole groups per mini-batch
        for r in range(2):
            assert len(set(uids[chunks[r][m * 2:(m + 1) * 2]].tolist())) == 1
