"""Token-capped packing of one rank's samples into a given number of non-empty bins.

Internal building blocks of the micro-batch planners: a feasibility search that finds the fewest
bins this module can fill under the cap (:func:`feasible_packing`), and a balancer that, for a
given bin count, builds a cap-respecting start and refines it by cost (:func:`balanced_capped_bins`).
Its fallback start, the bins of a feasible packing split until the count is reached, makes the
balancer succeed for every count between the feasible count and the number of samples: splitting a
bin never adds tokens to any bin.
"""

from __future__ import annotations

import heapq

import numpy as np

from .partition import karmarkar_karp
from .refine import refine_partition


def check_cap(tokens: np.ndarray, max_tokens: int) -> None:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if tokens.size and tokens.max() > max_tokens:
        i = int(np.argmax(tokens))
        raise ValueError(
            f"sample {i} has {int(tokens[i])} tokens, more than the micro-batch token budget "
            f"max_tokens={max_tokens}; raise the budget or truncate that sample"
        )


def _fits(tokens: np.ndarray, bins: list[list[int]], max_tokens: int) -> bool:
    return all(len(b) > 0 and tokens[b].sum() <= max_tokens for b in bins)


def _first_fit_decreasing(tokens: np.ndarray, max_tokens: int) -> list[list[int]]:
    """Classic FFD by tokens: always feasible when every sample fits; at most 11/9 OPT + 6/9 bins."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in np.lexsort((np.arange(len(tokens)), -tokens)):
        t = int(tokens[i])
        for b, load in enumerate(loads):
            if load + t <= max_tokens:
                bins[b].append(int(i))
                loads[b] += t
                break
        else:
            bins.append([int(i)])
            loads.append(t)
    return bins


def _cap_aware_lpt(weights: np.ndarray, tokens: np.ndarray, k: int, max_tokens: int) -> list[list[int]] | None:
    """Heaviest item first into the lightest (by ``weights``) bin where it still fits; None if stuck."""
    bins: list[list[int]] = [[] for _ in range(k)]
    loads = [0.0] * k
    room = [int(max_tokens)] * k
    w_list, t_list = weights.tolist(), tokens.tolist()
    for i in np.lexsort((np.arange(len(weights)), -weights)).tolist():
        t, best = t_list[i], -1
        for b in range(k):  # plain loop: k is small and numpy's per-call overhead dominates here
            if room[b] >= t and (best < 0 or loads[b] < loads[best]):
                best = b
        if best < 0:
            return None
        bins[best].append(i)
        loads[best] += w_list[i]
        room[best] -= t
    return bins if all(bins) else None


def _packing_with_k(tokens: np.ndarray, k: int, max_tokens: int) -> list[list[int]] | None:
    """A cap-respecting packing into exactly ``k`` non-empty bins, or None if these heuristics miss."""
    bins = karmarkar_karp(tokens, k)
    if _fits(tokens, bins, max_tokens):
        return bins
    return _cap_aware_lpt(tokens.astype(np.float64), tokens, k, max_tokens)


def feasible_packing(tokens: np.ndarray, max_tokens: int) -> list[list[int]]:
    """The packing with the fewest bins found by: balanced token packings at ``ceil(total/cap)``
    bins and upward, stopping at the first-fit-decreasing count (which is always feasible)."""
    n = len(tokens)
    if n == 0:
        return []
    ffd = _first_fit_decreasing(tokens, max_tokens)
    lower = max(1, -(-int(tokens.sum()) // max_tokens))
    for k in range(lower, len(ffd)):
        bins = _packing_with_k(tokens, k, max_tokens)
        if bins is not None:
            return bins
    return ffd


def split_to_count(weights: np.ndarray, bins: list[list[int]], k: int) -> list[list[int]]:
    """Split the heaviest multi-item bin in two (balanced by weight) until there are ``k`` bins.

    Splitting never adds tokens to a bin, so a feasible packing stays feasible.
    """
    bins = [list(b) for b in bins]
    heap = [(-float(weights[b].sum()), n, b) for n, b in enumerate(bins) if len(b) > 1]
    heapq.heapify(heap)
    singles = [b for b in bins if len(b) == 1]
    serial = len(bins)
    count = len(bins)
    while count < k:
        assert heap, "split_to_count: fewer samples than bins requested"
        _, _, b = heapq.heappop(heap)
        halves = karmarkar_karp(weights[b], 2)
        for half in halves:
            part = [b[j] for j in half]
            if len(part) > 1:
                heapq.heappush(heap, (-float(weights[part].sum()), serial, part))
                serial += 1
            else:
                singles.append(part)
        count += 1
    return [b for _, _, b in heap] + singles


def balanced_capped_bins(
    costs: np.ndarray, tokens: np.ndarray, k: int, max_tokens: int, base: list[list[int]]
) -> list[list[int]]:
    """``k`` non-empty bins under the cap with the heaviest bin (by ``costs``) as light as found.

    Starting point: cap-aware LPT by cost, or, if that gets stuck, ``base`` (a feasible packing with
    at most ``k`` bins) with its heaviest bins split until there are ``k``, which always works. The
    start is then refined by cap-respecting exchanges.
    """
    start = _cap_aware_lpt(costs, tokens, k, max_tokens)
    if start is None:
        start = split_to_count(costs, base, k)
    return refine_partition(costs, start, keep_sizes=False, tokens=tokens, max_tokens=max_tokens)
