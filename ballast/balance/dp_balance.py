"""DP balance: spread one step's samples over the data-parallel ranks, equal sample counts per rank,
balanced by workload, and report verl-named metrics on the raw and the balanced split.

The driver applies ``plan.order`` to the batch and then cuts it into ``dp_size`` contiguous equal
chunks (what a DP dispatch does), so rank ``r`` receives ``plan.partitions[r]``.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Sequence

import numpy as np

from .partition import greedy_partition, karmarkar_karp, validate_partition
from .refine import refine_partition
from .workload import Workload, _as_lengths, workload_costs

# Nodes the exact-fill search for unequal uid groups may visit before giving up.
_GROUP_SEARCH_BUDGET = 200_000


@dataclasses.dataclass(frozen=True)
class BalancePlan:
    """``order``: permutation of ``range(N)``; ``batch[order]`` chunked into ``dp_size`` equal parts
    gives rank ``r`` the samples ``partitions[r]`` (original indices, ascending). ``metrics``: see
    :func:`balance_metrics`."""

    order: np.ndarray
    partitions: list[np.ndarray]
    metrics: dict[str, float]


def _side_metrics(values: np.ndarray, partitions: Sequence[np.ndarray], dp_size: int, prefix: str) -> dict:
    raw = values.reshape(dp_size, -1).sum(axis=1)  # the contiguous split the batch would get unbalanced
    balanced = np.array([values[p].sum() for p in partitions])
    mean = float(values.sum()) / dp_size
    cast = int if np.issubdtype(values.dtype, np.integer) else float
    return {
        f"{prefix}/min": cast(raw.min()),
        f"{prefix}/max": cast(raw.max()),
        f"{prefix}/minmax_diff": cast(raw.max() - raw.min()),
        f"{prefix}/balanced_min": cast(balanced.min()),
        f"{prefix}/balanced_max": cast(balanced.max()),
        f"{prefix}/mean": mean,
        f"{prefix}/imbalance": float(raw.max()) / mean if mean > 0 else 1.0,
        f"{prefix}/balanced_imbalance": float(balanced.max()) / mean if mean > 0 else 1.0,
    }


def balance_metrics(
    lengths: Any, costs: np.ndarray, partitions: Sequence[np.ndarray], dp_size: int
) -> dict[str, float]:
    """verl's ``global_seqlen/{min,max,minmax_diff}`` (per-rank token sums of the original contiguous
    split), ``/balanced_{min,max}`` (of ``partitions``), ``/mean``; the same under ``global_workload/``
    for the costs; and ``/imbalance`` and ``/balanced_imbalance`` = max / mean of each split."""
    out = _side_metrics(_as_lengths(lengths), partitions, dp_size, "global_seqlen")
    out.update(_side_metrics(np.asarray(costs, dtype=np.float64), partitions, dp_size, "global_workload"))
    return out


def _best_equal_size(weights: np.ndarray, k: int) -> list[list[int]]:
    """KK and LPT (equal sizes), each refined by swaps; the one with the lighter heaviest part."""
    best, best_max = None, None
    for start in (karmarkar_karp(weights, k, equal_size=True), greedy_partition(weights, k, equal_size=True)):
        parts = refine_partition(weights, start, keep_sizes=True)
        heaviest = max(float(weights[p].sum()) for p in parts)
        if best_max is None or heaviest < best_max:
            best, best_max = parts, heaviest
    assert best is not None
    return best


def _describe_sizes(sizes: np.ndarray) -> str:
    counts = collections.Counter(int(s) for s in sizes)
    return ", ".join(f"{num} group(s) of {size}" for size, num in sorted(counts.items(), reverse=True))


def _fill_exactly(sizes: np.ndarray, costs: np.ndarray, dp_size: int, per_rank: int) -> list[list[int]] | None:
    """Assign groups to ranks so every rank holds exactly ``per_rank`` samples (iterative depth-first
    search, largest groups first, lightest rank first); None if no assignment exists."""
    order = [int(g) for g in np.lexsort((np.arange(len(sizes)), -costs, -sizes))]
    room = [per_rank] * dp_size
    load = [0.0] * dp_size
    chosen: list[int] = []  # rank chosen for order[0..depth-1]
    # Feasibility of the rest depends only on the depth and the multiset of rooms: remember failures.
    failed: set[tuple[int, tuple[int, ...]]] = set()
    frames: list[list] = []  # per depth: [state, candidate ranks, next candidate position]
    visited = 0
    while len(chosen) < len(order):
        depth = len(chosen)
        if len(frames) == depth:
            state = (depth, tuple(sorted(room)))
            visited += 1
            if visited > _GROUP_SEARCH_BUDGET:
                raise RuntimeError("search budget exhausted")
            size = sizes[order[depth]]
            cands, seen_rooms = [], set()
            if state not in failed:
                for r in sorted(range(dp_size), key=lambda r: (load[r], r)):
                    if room[r] >= size and room[r] not in seen_rooms:
                        seen_rooms.add(room[r])  # ranks with equal room are interchangeable for feasibility
                        cands.append(r)
            frames.append([state, cands, 0])
        frame = frames[-1]
        if frame[2] < len(frame[1]):
            r = frame[1][frame[2]]
            frame[2] += 1
            g = order[depth]
            room[r] -= sizes[g]
            load[r] += costs[g]
            chosen.append(r)
            continue
        failed.add(frame[0])
        frames.pop()
        if not chosen:
            return None
        r = chosen.pop()
        g = order[len(chosen)]
        room[r] += sizes[g]
        load[r] -= costs[g]
    groups_of_rank: list[list[int]] = [[] for _ in range(dp_size)]
    for pos, r in enumerate(chosen):
        groups_of_rank[r].append(order[pos])
    return groups_of_rank


def _group_partitions(costs: np.ndarray, group_ids: Any, dp_size: int) -> list[list[int]]:
    ids = np.asarray(group_ids)
    if ids.shape != (len(costs),):
        raise ValueError(f"group_ids has shape {ids.shape}, expected ({len(costs)},) (one id per sample)")
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    rank_of_unique = np.argsort(np.argsort(first, kind="stable"), kind="stable")  # groups in first-seen order
    group_of_sample = rank_of_unique[inverse.reshape(-1)]
    num_groups = len(first)
    sizes = np.bincount(group_of_sample, minlength=num_groups)
    group_costs = np.bincount(group_of_sample, weights=costs, minlength=num_groups)
    per_rank = len(costs) // dp_size
    if (sizes == sizes[0]).all() and num_groups % dp_size == 0:
        group_parts = _best_equal_size(group_costs, dp_size)
    else:
        if sizes.max() > per_rank:
            group_parts = None
        else:
            try:
                group_parts = _fill_exactly(sizes, group_costs, dp_size, per_rank)
            except RuntimeError:
                raise ValueError(
                    f"could not place uid groups ({_describe_sizes(sizes)}) onto dp_size={dp_size} ranks of "
                    f"exactly {per_rank} samples each within the search budget"
                ) from None
        if group_parts is None:
            raise ValueError(
                f"uid groups ({_describe_sizes(sizes)}) cannot be split onto dp_size={dp_size} ranks of exactly "
                f"{per_rank} samples each without breaking a group"
            )
        # Swaps of equal-size groups keep every rank at exactly per_rank samples.
        group_parts = refine_partition(group_costs, group_parts, keep_sizes=True, tokens=sizes, max_tokens=per_rank)
    members = [np.flatnonzero(group_of_sample == g) for g in range(num_groups)]
    return [[int(i) for g in part for i in members[g]] for part in group_parts]


def balance_batch(
    lengths: Sequence[int] | np.ndarray,
    dp_size: int,
    workload: Workload = "tokens",
    group_ids: Sequence[Any] | np.ndarray | None = None,
) -> BalancePlan:
    """Equal-count partition of the samples over ``dp_size`` ranks, balanced by ``workload`` cost.

    ``lengths``: per-sample prompt + response tokens. ``group_ids`` (e.g. the uid of each sample's
    prompt): samples sharing an id stay on one rank.
    """
    tokens = _as_lengths(lengths)
    n = len(tokens)
    if isinstance(dp_size, bool) or not isinstance(dp_size, (int, np.integer)) or dp_size < 1:
        raise ValueError(f"dp_size must be a positive integer, got {dp_size!r}")
    if n % dp_size != 0:
        raise ValueError(
            f"balance_batch needs the number of samples N={n} to be divisible by dp_size={dp_size} "
            f"(N % dp_size = {n % dp_size}) so every rank gets the same count"
        )
    costs = workload_costs(tokens, workload)
    if group_ids is None:
        parts = _best_equal_size(costs, dp_size)
    else:
        parts = _group_partitions(costs, group_ids, dp_size)
    partitions = [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]
    validate_partition(partitions, n, k=dp_size, equal_size=True)
    order = np.concatenate(partitions) if n else np.zeros(0, dtype=np.int64)
    return BalancePlan(order=order, partitions=partitions, metrics=balance_metrics(tokens, costs, partitions, dp_size))
