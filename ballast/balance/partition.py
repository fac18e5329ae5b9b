"""Multi-way number partitioning: Karmarkar-Karp (largest differencing), greedy LPT, and a local
refinement that never makes the heaviest partition heavier.

All functions take per-item weights (any non-negative numbers: tokens, FLOPs), return ``k`` lists of
item indices that cover every index exactly once (checked by :func:`validate_partition` before they
are returned), and are deterministic: equal input gives equal output, ties broken by item index.
"""

from __future__ import annotations

import heapq
from typing import Any, Sequence

import numpy as np


def _as_weights(weights: Any) -> np.ndarray:
    if hasattr(weights, "detach"):  # torch tensor, without importing torch
        weights = weights.detach().cpu().numpy()
    arr = np.asarray(weights, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"weights must be 1-D, got shape {arr.shape}")
    if arr.size and (not np.all(np.isfinite(arr)) or arr.min() < 0):
        bad = int(np.flatnonzero(~np.isfinite(arr) | (arr < 0))[0])
        raise ValueError(f"weights must be finite and >= 0, got {arr[bad]!r} at index {bad}")
    return arr


def _check_k(num_items: int, k: int, equal_size: bool) -> None:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"number of partitions k must be a positive integer, got {k!r}")
    if equal_size and num_items % k != 0:
        raise ValueError(
            f"equal_size partitioning needs the number of items N={num_items} to be divisible by k={k} "
            f"(N % k = {num_items % k})"
        )


def validate_partition(
    partitions: Sequence[Sequence[int]],
    num_items: int,
    k: int | None = None,
    equal_size: bool = False,
    allow_empty: bool = True,
) -> None:
    """Raise ``ValueError`` unless ``partitions`` cover ``range(num_items)`` exactly once each.

    Optionally checks the number of partitions, equal partition sizes and non-emptiness.
    """
    if k is not None and len(partitions) != k:
        raise ValueError(f"expected {k} partitions, got {len(partitions)}")
    arrays = [np.asarray(part, dtype=np.int64).reshape(-1) for part in partitions]
    for p, idx in enumerate(arrays):
        if not allow_empty and idx.size == 0:
            raise ValueError(f"partition {p} is empty")
        if equal_size and idx.size * len(partitions) != num_items:
            raise ValueError(
                f"partition {p} has {idx.size} items; equal sizes need {num_items}/{len(partitions)} each"
            )
        if idx.size and (idx.min() < 0 or idx.max() >= num_items):
            bad = int(idx[(idx < 0) | (idx >= num_items)][0])
            raise ValueError(f"partition {p} holds index {bad}, outside [0, {num_items})")
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int64)
    seen = np.bincount(flat, minlength=num_items)
    if flat.size != num_items or (seen != 1).any():
        bad = int(np.flatnonzero(seen != 1)[0])
        raise ValueError(f"index {bad} appears {int(seen[bad])} times across partitions (expected exactly once)")


def _finish(partitions: list[list[int]], num_items: int, k: int, equal_size: bool) -> list[list[int]]:
    out = [sorted(int(i) for i in part) for part in partitions]
    validate_partition(out, num_items, k=k, equal_size=equal_size)
    return out


def karmarkar_karp(weights: Any, k: int, equal_size: bool = False) -> list[list[int]]:
    """Largest differencing method for ``k`` partitions.

    Each item starts as a k-slot state (with ``equal_size``: each run of ``k`` consecutive items in
    sorted order forms one state, one item per slot, so every partition ends with ``N/k`` items).
    The two states with the largest spread (max slot - min slot) are merged by pairing the heaviest
    slot of one with the lightest of the other, until one state is left.
    """
    w = _as_weights(weights)
    n = len(w)
    _check_k(n, k, equal_size)
    order = np.lexsort((np.arange(n), w))  # ascending weight, ties by index
    heap: list[tuple[float, float, int, list[float], list[list[int]]]] = []
    if equal_size:
        for seq, off in enumerate(range(0, n, k)):
            chunk = order[off : off + k][::-1]
            sums = [float(w[i]) for i in chunk]
            heap.append((-(sums[0] - sums[-1]), -sums[0], seq, sums, [[int(i)] for i in chunk]))
    else:
        for seq, i in enumerate(order[::-1]):
            sums = [float(w[i])] + [0.0] * (k - 1)
            heap.append((-sums[0], -sums[0], seq, sums, [[int(i)]] + [[] for _ in range(k - 1)]))
    heapq.heapify(heap)
    seq = len(heap)
    while len(heap) > 1:
        _, _, _, sums_a, items_a = heapq.heappop(heap)
        _, _, _, sums_b, items_b = heapq.heappop(heap)
        merged_sums = [0.0] * k
        merged_items: list[list[int]] = [None] * k  # type: ignore[list-item]
        for i in range(k):
            j = k - 1 - i
            merged_sums[i] = sums_a[i] + sums_b[j]
            big, small = (items_a[i], items_b[j]) if len(items_a[i]) >= len(items_b[j]) else (items_b[j], items_a[i])
            big.extend(small)  # small-to-large keeps the total copying O(N log N)
            merged_items[i] = big
        slot_order = sorted(range(k), key=merged_sums.__getitem__, reverse=True)
        sums = [merged_sums[s] for s in slot_order]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), -sums[0], seq, sums, [merged_items[s] for s in slot_order]))
        seq += 1
    partitions = heap[0][4] if heap else [[] for _ in range(k)]
    return _finish(partitions, n, k, equal_size)


def greedy_partition(weights: Any, k: int, equal_size: bool = False) -> list[list[int]]:
    """Longest-processing-time greedy: heaviest item first, into the lightest partition that still
    has room (with ``equal_size``, room means fewer than ``N/k`` items)."""
    w = _as_weights(weights)
    n = len(w)
    _check_k(n, k, equal_size)
    capacity = n // k if equal_size else n
    partitions: list[list[int]] = [[] for _ in range(k)]
    heap = [(0.0, p) for p in range(k)]
    for i in np.lexsort((np.arange(n), -w)):
        total, p = heapq.heappop(heap)
        partitions[p].append(int(i))
        if len(partitions[p]) < capacity:
            heapq.heappush(heap, (total + float(w[i]), p))
    return _finish(partitions, n, k, equal_size)


def partition_sums(weights: Any, partitions: Sequence[Sequence[int]]) -> np.ndarray:
    w = _as_weights(weights)
    return np.array([float(w[np.asarray(p, dtype=np.int64)].sum()) if len(p) else 0.0 for p in partitions])
