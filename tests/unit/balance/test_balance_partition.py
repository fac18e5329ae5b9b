"""Karmarkar-Karp, greedy LPT, refinement and validation: coverage, sizes, bounds, determinism."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ballast.balance.partition import greedy_partition, karmarkar_karp, partition_sums, validate_partition
from ballast.balance.refine import refine_partition

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def weights_and_k(draw, equal_size):
    k = draw(st.integers(1, 8))
    n = k * draw(st.integers(1, 12)) if equal_size else draw(st.integers(0, 60))
    weights = draw(st.lists(st.integers(0, 10_000), min_size=n, max_size=n))
    return weights, k


@SETTINGS
@given(weights_and_k(equal_size=False))
def test_unequal_partitions_cover_and_spread_at_most_largest_item(case):
    weights, k = case
    for fn in (karmarkar_karp, greedy_partition):
        parts = fn(weights, k)
        validate_partition(parts, len(weights), k=k)
        sums = partition_sums(weights, parts)
        # Both methods: the heaviest partition exceeds the lightest by at most one item.
        assert sums.max() - sums.min() <= max(weights, default=0)


@SETTINGS
@given(weights_and_k(equal_size=True))
def test_equal_size_partitions_have_n_over_k_items(case):
    weights, k = case
    w = np.asarray(weights, dtype=float)
    parts = karmarkar_karp(w, k, equal_size=True)
    validate_partition(parts, len(w), k=k, equal_size=True)
    # KK merges never widen the spread: final spread <= the widest chunk of k sorted neighbours.
    s = np.sort(w)
    chunk_spread = max((s[i + k - 1] - s[i] for i in range(0, len(s), k)), default=0.0)
    sums = partition_sums(w, parts)
    assert sums.max() - sums.min() <= chunk_spread + 1e-9
    validate_partition(greedy_partition(w, k, equal_size=True), len(w), k=k, equal_size=True)


@SETTINGS
@given(weights_and_k(equal_size=False), st.booleans(), st.integers(0, 2**31 - 1))
def test_refinement_never_increases_the_heaviest_partition(case, keep_sizes, seed):
    weights, k = case
    rng = np.random.default_rng(seed)
    assignment = rng.integers(0, k, len(weights))
    start = [np.flatnonzero(assignment == p).tolist() for p in range(k)]
    refined = refine_partition(weights, start, keep_sizes=keep_sizes)
    validate_partition(refined, len(weights), k=k)
    assert partition_sums(weights, refined).max() <= partition_sums(weights, start).max()
    if keep_sizes:
        assert sorted(map(len, refined)) == sorted(map(len, start))
    else:  # moves never empty a partition that had items
        assert sum(1 for p in refined if p) >= sum(1 for p in start if p)


@SETTINGS
@given(st.lists(st.tuples(st.integers(1, 1000), st.integers(1, 50)), min_size=2, max_size=40), st.integers(2, 6))
def test_refinement_respects_a_token_cap(items, k):
    weights = [w for w, _ in items]
    tokens = np.array([t for _, t in items])
    cap = int(tokens.max()) + 40
    start = [list(range(p, len(items), k)) for p in range(k)]  # round robin, then make it feasible
    if any(tokens[p].sum() > cap for p in start if p):
        cap = int(max(tokens[p].sum() for p in start if p))
    refined = refine_partition(weights, start, keep_sizes=False, tokens=tokens, max_tokens=cap)
    assert all(tokens[p].sum() <= cap for p in refined if p)
    assert partition_sums(weights, refined).max() <= partition_sums(weights, start).max()


def test_refinement_improves_a_bad_split():
    weights = [10, 9, 8, 1, 1, 1]
    refined = refine_partition(weights, [[0, 1, 2], [3, 4, 5]], keep_sizes=True)
    # 27 vs 3 to the best 3 + 3 split there is: {9, 8, 1} = 18 vs {10, 1, 1} = 12.
    assert sorted(partition_sums(weights, refined).tolist()) == [12.0, 18.0]
    moved = refine_partition(weights, [[0, 1, 2], [3, 4, 5]], keep_sizes=False)
    assert partition_sums(weights, moved).max() == 17  # moves allowed: {9, 8} vs {10, 1, 1, 1} is optimal


def test_kk_finds_the_perfect_split_and_is_deterministic():
    weights = [8, 7, 6, 5, 4, 3, 2, 1]
    parts = karmarkar_karp(weights, 2, equal_size=True)
    assert partition_sums(weights, parts).tolist() == [18.0, 18.0]
    rng = np.random.default_rng(0)
    w = rng.integers(1, 100, 500)  # many ties
    assert karmarkar_karp(w, 7) == karmarkar_karp(w.copy(), 7)
    assert greedy_partition(w, 5, equal_size=True) == greedy_partition(list(w), 5, equal_size=True)


def test_errors_name_the_numbers():
    with pytest.raises(ValueError, match=r"N=10 .*k=3"):
        karmarkar_karp(list(range(10)), 3, equal_size=True)
    with pytest.raises(ValueError, match=r"N=7 .*k=2"):
        greedy_partition(list(range(7)), 2, equal_size=True)
    with pytest.raises(ValueError, match="positive integer"):
        karmarkar_karp([1, 2], 0)
    with pytest.raises(ValueError, match="index 1"):
        karmarkar_karp([1.0, float("nan")], 2)


def test_validate_partition_catches_every_violation():
    validate_partition([[0, 2], [1, 3]], 4, k=2, equal_size=True, allow_empty=False)
    with pytest.raises(ValueError, match="index 2 appears 2 times"):
        validate_partition([[0, 2], [1, 2]], 3)
    with pytest.raises(ValueError, match="index 3 appears 0 times"):
        validate_partition([[0, 2], [1]], 4)
    with pytest.raises(ValueError, match="outside"):
        validate_partition([[0, 5]], 2)
    with pytest.raises(ValueError, match="partition 1 is empty"):
        validate_partition([[0, 1], []], 2, allow_empty=False)
    with pytest.raises(ValueError, match="equal sizes"):
        validate_partition([[0, 1, 2], [3]], 4, equal_size=True)
    with pytest.raises(ValueError, match="expected 3 partitions"):
        validate_partition([[0], [1]], 2, k=3)
