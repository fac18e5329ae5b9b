"""Micro-batch plans for one DP rank: static (fixed samples per micro-batch) and dynamic (a hard
token cap per micro-batch, balanced by workload), plus inverse permutations to restore order.

The dynamic plan has two entry points that together make the DP all-reduce safe:
``min_micro_batches(lengths, cap)`` is the count this rank needs, and
``plan_dynamic_micro_batches(lengths, cap, num_micro_batches=k)`` succeeds for EVERY
``min_micro_batches(...) <= k <= len(lengths)``. So the engine can all-reduce MAX of the first over
the DP group and call the second with the result on every rank: equal counts, no hang, no rank that
raises while its peers wait. Micro-batches come back ordered by decreasing cost, so the j-th
micro-batches of different ranks (run in lockstep under FSDP) have similar cost.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .packing import balanced_capped_bins, check_cap, feasible_packing
from .partition import validate_partition
from .workload import Workload, _as_lengths, workload_costs


def plan_static_micro_batches(num_samples: int, micro_batch_size: int) -> list[np.ndarray]:
    """Consecutive chunks of exactly ``micro_batch_size`` samples (verl's static path)."""
    for name, value in (("num_samples", num_samples), ("micro_batch_size", micro_batch_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    if num_samples % micro_batch_size != 0:
        raise ValueError(
            f"num_samples={num_samples} is not divisible by micro_batch_size={micro_batch_size} "
            f"(remainder {num_samples % micro_batch_size}); static micro-batching needs equal micro-batches"
        )
    return [np.arange(s, s + micro_batch_size, dtype=np.int64) for s in range(0, num_samples, micro_batch_size)]


def _tokens_and_cap(lengths: Any, max_tokens: int) -> np.ndarray:
    tokens = _as_lengths(lengths)
    check_cap(tokens, max_tokens)
    return tokens


def min_micro_batches(lengths: Sequence[int] | np.ndarray, max_tokens: int) -> int:
    """Fewest micro-batches this module can pack ``lengths`` into with token sums <= ``max_tokens``.

    At least ``ceil(sum / max_tokens)``; found by balanced packings from that count upward, bounded
    by first-fit-decreasing. Raises ``ValueError`` (index, length, budget) if one sample is too long.
    """
    tokens = _tokens_and_cap(lengths, max_tokens)
    return len(feasible_packing(tokens, max_tokens))


def order_by_decreasing_cost(costs: np.ndarray, bins: list[list[int]]) -> list[np.ndarray]:
    """Bins as sorted index arrays, heaviest first (ties: smaller first index first)."""
    arrays = [np.sort(np.asarray(b, dtype=np.int64)) for b in bins]
    keys = [(-float(costs[a].sum()), int(a[0]) if a.size else -1) for a in arrays]
    return [arrays[i] for i in sorted(range(len(arrays)), key=keys.__getitem__)]


def plan_dynamic_micro_batches(
    lengths: Sequence[int] | np.ndarray,
    max_tokens: int,
    num_micro_batches: int | None = None,
    workload: Workload = "tokens",
) -> list[np.ndarray]:
    """Split one rank's samples into non-empty micro-batches whose token sums are <= ``max_tokens``,
    balanced by ``workload`` cost, ordered by decreasing cost.

    ``num_micro_batches=None`` uses :func:`min_micro_batches`; any ``k`` with
    ``min_micro_batches(lengths, max_tokens) <= k <= len(lengths)`` is guaranteed to succeed.
    """
    tokens = _tokens_and_cap(lengths, max_tokens)
    costs = workload_costs(tokens, workload)
    return _plan_dynamic(tokens, costs, max_tokens, num_micro_batches)


def _plan_dynamic(
    tokens: np.ndarray,
    costs: np.ndarray,
    max_tokens: int,
    num_micro_batches: int | None,
    base: list[list[int]] | None = None,
) -> list[np.ndarray]:
    n = len(tokens)
    if base is None:
        base = feasible_packing(tokens, max_tokens)
    k = len(base) if num_micro_batches is None else num_micro_batches
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"num_micro_batches must be an int or None, got {type(k).__name__}")
    if n == 0:
        if k != 0:
            raise ValueError(f"num_micro_batches={k} requested for 0 samples; micro-batches may not be empty")
        return []
    if k < len(base) or k > n:
        raise ValueError(
            f"num_micro_batches={k} is outside [{len(base)}, {n}]: {n} samples with "
            f"{int(tokens.sum())} tokens need at least {len(base)} micro-batches of <= {max_tokens} tokens, "
            f"and no micro-batch may be empty"
        )
    bins = balanced_capped_bins(costs, tokens, int(k), max_tokens, base)
    validate_partition(bins, n, k=int(k), allow_empty=False)
    for b in bins:
        assert tokens[b].sum() <= max_tokens, "packing broke the token cap"
    return order_by_decreasing_cost(costs, bins)


def inverse_permutation(order: Sequence[int] | np.ndarray) -> np.ndarray:
    """``inv`` with ``inv[order[i]] = i``: ``x[order][inv]`` restores ``x``.

    For micro-batches, pass ``np.concatenate(micro_batches)``.
    """
    arr = np.asarray(order)
    if arr.ndim != 1:
        raise ValueError(f"order must be 1-D, got shape {arr.shape}")
    arr = arr.astype(np.int64)
    validate_partition([arr], len(arr))
    inv = np.empty_like(arr)
    inv[arr] = np.arange(len(arr), dtype=np.int64)
    return inv
