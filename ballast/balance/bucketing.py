"""Length-bucketed dynamic micro-batches: short prompts are not packed with long ones.

Samples are grouped by prompt length with `bucket_boundaries` (e.g. [64, 256, 1024, 4096]: prompts of
<= 64 tokens, 65..256, ..., > 4096) and every micro-batch holds samples of one bucket only. The two
properties the engine relies on still hold: every micro-batch is under the token cap, and any count k
with `min_bucketed_micro_batches(...) <= k <= len(lengths)` can be planned, so DP ranks can agree
on a count with an all-reduce MAX. Extra micro-batches (k above this rank's minimum) go to the
buckets whose micro-batches are heaviest.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .micro_batch import min_micro_batches, order_by_decreasing_cost, plan_dynamic_micro_batches
from .workload import Workload, _as_lengths, workload_costs


def check_bucket_boundaries(boundaries: Sequence[int]) -> np.ndarray:
    """`boundaries` as an int64 array, or a ValueError unless they are positive and strictly increasing."""
    bounds = np.asarray(boundaries, dtype=np.int64)
    if bounds.ndim != 1 or bounds.size == 0 or np.any(bounds <= 0) or np.any(np.diff(bounds) <= 0):
        raise ValueError(f"bucket_boundaries={list(boundaries)} must be positive and strictly increasing")
    return bounds


def bucket_ids(prompt_lengths: Sequence[int] | np.ndarray, boundaries: Sequence[int]) -> np.ndarray:
    """Bucket of each sample: 0 for prompts <= boundaries[0], ..., len(boundaries) beyond the last."""
    bounds = check_bucket_boundaries(boundaries)
    return np.searchsorted(bounds, _as_lengths(prompt_lengths), side="left").astype(np.int64)


def _groups(buckets: np.ndarray) -> list[np.ndarray]:
    return [np.flatnonzero(buckets == b) for b in np.unique(buckets)]


def min_bucketed_micro_batches(lengths, buckets, max_tokens: int) -> int:
    """Fewest micro-batches under the cap when no micro-batch mixes buckets."""
    tokens, buckets = _check(lengths, buckets)
    return sum(min_micro_batches(tokens[g], max_tokens) for g in _groups(buckets))


def plan_bucketed_micro_batches(lengths, buckets, max_tokens: int, num_micro_batches: int | None = None,
                                workload: Workload = "tokens") -> list[np.ndarray]:
    """Capped, single-bucket micro-batches (exactly `num_micro_batches` of them when given), heaviest first."""
    tokens, buckets = _check(lengths, buckets)
    groups = _groups(buckets)
    counts = [min_micro_batches(tokens[g], max_tokens) for g in groups]
    k = sum(counts) if num_micro_batches is None else int(num_micro_batches)
    if not sum(counts) <= k <= len(tokens):
        raise ValueError(
            f"num_micro_batches={k} is outside [{sum(counts)}, {len(tokens)}] for {len(tokens)} samples in "
            f"{len(groups)} prompt-length bucket(s) with a cap of {max_tokens} tokens"
        )
    costs = workload_costs(tokens, workload)
    totals = [float(costs[g].sum()) for g in groups]
    for _ in range(k - sum(counts)):
        # Split where micro-batches are heaviest, among buckets that still have a sample to spare.
        open_ = [i for i, g in enumerate(groups) if counts[i] < len(g)]
        target = max(open_, key=lambda i: (totals[i] / counts[i], -i))
        counts[target] += 1
    bins: list[np.ndarray] = []
    for group, count in zip(groups, counts):
        for local in plan_dynamic_micro_batches(tokens[group], max_tokens, num_micro_batches=count, workload=workload):
            bins.append(group[local])
    return order_by_decreasing_cost(costs, [b.tolist() for b in bins])


def _check(lengths, buckets) -> tuple[np.ndarray, np.ndarray]:
    tokens = _as_lengths(lengths)
    buckets = np.asarray(buckets, dtype=np.int64)
    if buckets.shape != tokens.shape:
        raise ValueError(f"{len(buckets)} bucket ids for {len(tokens)} samples")
    return tokens, buckets
