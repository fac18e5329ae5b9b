"""plan_phase over prompt units: a prompt's rows are never split (rank, mini-batch, micro-batch), every
row runs exactly once, and the token budget holds for the tokens a shared micro-batch executes."""

import numpy as np
import pytest

from ballast.balance import MicroBatchPolicy, plan_phase
from ballast.balance.shared_prompts import micro_batch_tokens, prompt_units, shared_lengths

N_PROMPTS, N = 12, 4


def _rows(seed=0, n_prompts=N_PROMPTS, n=N):
    rng = np.random.default_rng(seed)
    prompt_of = rng.permutation(np.repeat(np.arange(n_prompts), n))  # a prompt's rows scattered over the batch
    prompt_lengths = rng.integers(20, 80, n_prompts)[prompt_of]
    lengths = prompt_lengths + rng.integers(0, 60, len(prompt_of))
    return lengths, prompt_lengths, prompt_of


def _micro_batches(plan):
    """(mini-batch index, rank, step rows) of every micro-batch."""
    for m, mini in enumerate(plan.mini_batches):
        for r, part in enumerate(plan.partitions(m)):
            for mb in mini.for_rank(r):
                yield m, r, part[mb]


@pytest.mark.parametrize("shuffle,epochs", [(False, 1), (True, 2)])
def test_prompts_stay_whole_and_the_budget_counts_each_prompt_once(shuffle, epochs):
    lengths, prompt_lengths, prompt_of = _rows()
    budget = 400
    plan = plan_phase(lengths, 2, MicroBatchPolicy("dynamic", token_budget=budget), mini_batch_samples=24,
                      shuffle=shuffle, seed=3, epochs=epochs, shared_prompts=prompt_of, prompt_lengths=prompt_lengths)
    assert all(mini.shared_prompts for mini in plan.mini_batches)
    seen, over_plain = [], 0
    for _, _, rows in _micro_batches(plan):
        seen.extend(rows.tolist())
        for p in np.unique(prompt_of[rows]):  # every row of each prompt in this micro-batch
            assert np.isin(np.flatnonzero(prompt_of == p), rows).all()
        assert micro_batch_tokens(lengths, prompt_lengths, prompt_of, rows) <= budget
        over_plain += int(lengths[rows].sum() > budget)
    assert sorted(seen) == sorted(list(range(len(lengths))) * epochs)
    assert over_plain > 0  # the shared count is what let these micro-batches hold their rows
    units = prompt_units(prompt_of)
    expected = shared_lengths(lengths, prompt_lengths, units).sum() / lengths.sum()
    assert plan.metrics["plan/shared_token_fraction"] == pytest.approx(expected)
    assert plan.rank_sizes() == (len(lengths) * epochs // 2,) * 2


def test_static_micro_batches_hold_whole_prompts_or_are_refused():
    lengths, prompt_lengths, prompt_of = _rows(1)
    plan = plan_phase(lengths, 2, MicroBatchPolicy("static", micro_batch_size=8), shared_prompts=prompt_of,
                      prompt_lengths=prompt_lengths)
    for _, _, rows in _micro_batches(plan):
        assert len(rows) == 8 and len(np.unique(prompt_of[rows])) == 2
    with pytest.raises(ValueError, match="micro_batch_size=6 rows is not a whole number of prompts sharing 4"):
        plan_phase(lengths, 2, MicroBatchPolicy("static", micro_batch_size=6), shared_prompts=prompt_of,
                   prompt_lengths=prompt_lengths)


def test_what_cannot_be_planned_over_whole_prompts_is_refused_by_name():
    lengths, prompt_lengths, prompt_of = _rows(2)
    policy = MicroBatchPolicy("dynamic", token_budget=400)
    uneven = prompt_of.copy()
    uneven[uneven == 1] = 0  # one prompt with 8 rows, the others with 4
    with pytest.raises(ValueError, match=r"group sizes \[4, 8\]"):
        plan_phase(lengths, 2, policy, shared_prompts=uneven, prompt_lengths=prompt_lengths)
    with pytest.raises(ValueError, match="over the micro-batch token budget 100"):
        plan_phase(lengths, 2, MicroBatchPolicy("dynamic", token_budget=100), shared_prompts=prompt_of,
                   prompt_lengths=prompt_lengths)
    with pytest.raises(ValueError, match="do not split over dp_size=5"):
        plan_phase(lengths, 5, policy, shared_prompts=prompt_of, prompt_lengths=prompt_lengths)
    with pytest.raises(ValueError, match="mini-batches of 20 rows"):
        plan_phase(lengths, 2, policy, mini_batch_samples=20, shared_prompts=prompt_of, prompt_lengths=prompt_lengths)


def test_a_fixed_partition_of_whole_prompts_is_kept_and_a_split_prompt_refused():
    lengths, prompt_lengths, prompt_of = _rows(3, n_prompts=4)
    units = prompt_units(prompt_of)
    parts = [units.rows([0, 2]), units.rows([1, 3])]
    plan = plan_phase(lengths, 2, MicroBatchPolicy("dynamic", token_budget=300), partitions=parts,
                      shared_prompts=prompt_of, prompt_lengths=prompt_lengths)
    assert [sorted(p.tolist()) for p in plan.partitions()] == [sorted(p.tolist()) for p in parts]
    for _, r, rows in _micro_batches(plan):
        assert set(prompt_of[rows]) <= set(prompt_of[parts[r]])
    broken = [np.concatenate([parts[0][1:], parts[1][:1]]), np.concatenate([parts[1][1:], parts[0][:1]])]
    with pytest.raises(ValueError, match="whole prompts"):
        plan_phase(lengths, 2, MicroBatchPolicy("dynamic", token_budget=300), partitions=broken,
                   shared_prompts=prompt_of, prompt_lengths=prompt_lengths)
