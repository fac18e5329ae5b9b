"""plan_step: the one plan the trainer runs. Coverage, equal counts, the cap, group keeping,
determinism, never worse than the planners it supersedes, and its lower bounds checked against a
brute-force optimum on tiny steps."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ballast.balance import FlopsModel, workload_costs
from ballast.balance.dp_balance import balance_batch
from ballast.balance.joint import lockstep_cost, plan_joint_micro_batches
from ballast.balance.micro_batch import min_micro_batches, plan_dynamic_micro_batches
from ballast.balance.step_plan import lockstep_lower_bounds, plan_step

SMALL_MODEL = FlopsModel(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                         vocab_size=1000)


def _check_plan(plan, tokens, dp, cap):
    n = len(tokens)
    assert plan.dp_size == dp
    flat = np.concatenate([mb for rank in plan.micro_batches for mb in rank])
    assert np.array_equal(np.sort(flat), np.arange(n)), "every index exactly once"
    assert {len(rank) for rank in plan.micro_batches} == {plan.num_micro_batches}
    assert all(len(p) == n // dp for p in plan.partitions)
    assert all(len(mb) > 0 and tokens[mb].sum() <= cap for rank in plan.micro_batches for mb in rank)
    assert np.array_equal(plan.order, np.concatenate(plan.partitions))
    chunks = np.split(plan.order, dp)
    for r, local in enumerate(plan.local_micro_batches()):
        for j, rows in enumerate(local):
            assert np.array_equal(chunks[r][rows], plan.micro_batches[r][j])


@st.composite
def steps(draw):
    cap = draw(st.integers(100, 4000))
    dp = draw(st.integers(1, 4))
    per_rank = draw(st.integers(1, 12))
    lengths = draw(st.lists(st.integers(1, cap), min_size=dp * per_rank, max_size=dp * per_rank))
    return np.asarray(lengths), dp, cap


@settings(max_examples=40, deadline=None)
@given(steps(), st.sampled_from(["tokens", "verl", SMALL_MODEL]))
def test_plan_is_complete_capped_equal_and_no_worse_than_the_previous_paths(step, workload):
    tokens, dp, cap = step
    plan = plan_step(tokens, dp, cap, workload)
    _check_plan(plan, tokens, dp, cap)
    costs = workload_costs(tokens, workload)
    got = lockstep_cost([[costs[mb].sum() for mb in rank] for rank in plan.micro_batches])
    assert got == pytest.approx(plan.lockstep_cost)
    assert plan.lower_bound <= plan.attainable_lower_bound * (1 + 1e-12)
    assert plan.attainable_lower_bound <= got * (1 + 1e-9)
    parts = balance_batch(tokens, dp, workload=workload).partitions
    joint = plan_joint_micro_batches([tokens[p] for p in parts], cap, workload=workload)
    assert got <= lockstep_cost([[costs[p][mb].sum() for mb in rank] for p, rank in zip(parts, joint)]) * (1 + 1e-12)
    count = max(min_micro_batches(tokens[p], cap) for p in parts)  # the engine's all-reduce MAX path
    per_rank = [plan_dynamic_micro_batches(tokens[p], cap, count, workload) for p in parts]
    assert got <= lockstep_cost([[costs[p][mb].sum() for mb in rank] for p, rank in zip(parts, per_rank)]) * (1 + 1e-12)


def _set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for sub in _set_partitions(rest):
        for i in range(len(sub)):
            yield sub[:i] + [[first] + sub[i]] + sub[i + 1:]
        yield [[first]] + sub


def _brute_force_optimum(tokens, costs, dp, cap):
    """Lowest lockstep cost over every equal-count DP split and every capped micro-batch cut
    (each rank's micro-batches sorted by cost, which is optimal for fixed micro-batches)."""
    n = len(tokens)
    per_rank = n // dp
    best = np.inf
    for assignment in itertools.product(range(dp), repeat=n):
        if any(assignment.count(r) != per_rank for r in range(dp)):
            continue
        ranks = [[i for i in range(n) if assignment[i] == r] for r in range(dp)]
        options = []
        for items in ranks:
            cuts = {}
            for part in _set_partitions(items):
                if all(tokens[b].sum() <= cap for b in part):
                    sums = sorted((costs[b].sum() for b in part), reverse=True)
                    k = len(sums)
                    cuts.setdefault(k, []).append(sums)
            options.append(cuts)
        for k in set.intersection(*(set(o) for o in options)):
            for combo in itertools.product(*(o[k] for o in options)):
                best = min(best, float(np.max(np.asarray(combo), axis=0).sum()))
    return best


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 6).flatmap(lambda n: st.tuples(
    st.lists(st.integers(1, 100), min_size=n, max_size=n), st.sampled_from([d for d in (1, 2, 3) if n % d == 0]),
    st.integers(100, 300))))
def test_lower_bounds_hold_against_the_brute_force_optimum(case):
    lengths, dp, cap = case
    tokens = np.asarray(lengths)
    costs = workload_costs(tokens, "verl")
    optimum = _brute_force_optimum(tokens, costs, dp, cap)
    perfect, attainable = lockstep_lower_bounds(tokens, dp, cap, "verl")
    assert perfect <= attainable <= optimum * (1 + 1e-12)
    assert plan_step(tokens, dp, cap, "verl").lockstep_cost >= optimum * (1 - 1e-12)


def test_attainable_bound_sees_indivisible_samples_and_the_cap():
    # N == dp: one sample per rank, one micro-step costing the longest sample.
    tokens = np.array([1000, 10, 10, 10])
    perfect, attainable = lockstep_lower_bounds(tokens, 4, 1000)
    assert perfect == 257.5 and attainable == 1000
    plan = plan_step(tokens, 4, 1000)
    assert plan.lockstep_cost == 1000 and plan.num_micro_batches == 1


def test_groups_stay_on_one_rank_and_plans_are_deterministic():
    rng = np.random.default_rng(3)
    uids = np.repeat(np.arange(16), 4)
    tokens = rng.integers(50, 2000, 64)
    a = plan_step(tokens, 4, 4096, "verl", group_ids=uids)
    b = plan_step(tokens.copy(), 4, 4096, "verl", group_ids=uids.copy())
    _check_plan(a, tokens, 4, 4096)
    for part in a.partitions:
        for uid in np.unique(uids[part]):
            assert np.isin(np.flatnonzero(uids == uid), part).all(), f"group {uid} was split"
    assert a.candidate == b.candidate
    assert all(np.array_equal(x, y) for ra, rb in zip(a.micro_batches, b.micro_batches) for x, y in zip(ra, rb))


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="divisible by dp=3"):
        plan_step([1, 2, 3, 4], 3, 100)
    with pytest.raises(ValueError, match="100"):
        plan_step([1, 200], 2, 100)
    with pytest.raises(ValueError, match="dp must be a positive integer"):
        plan_step([1, 2], 0, 100)
