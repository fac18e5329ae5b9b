"""Local refinement of a partition: exchanges between the heaviest partition and lighter ones.

Each accepted exchange (a swap of one item each way, or, when sizes may change, a single move out
of the heaviest partition) moves a weight ``delta`` with ``0 < delta < gap`` between the heaviest
partition ``H`` and a lighter one ``P`` (``gap = sum(H) - sum(P)``), so both new sums stay strictly
below the old ``sum(H)``: the maximum never increases, and the sum of squared partition sums strictly
decreases, so the search terminates. The exchange taken is the one with the lowest new
``max(sum(H), sum(P))`` (a moved weight closest to ``gap / 2``): over all partners at once for small
inputs, from the lightest partner up for large ones. An optional second quantity (tokens) may be
held under a cap by every exchange.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from .partition import _as_weights, validate_partition

# Candidates examined on each side of the ideal partner weight in the sorted lighter partition: with
# no token cap the nearest two are optimal; the wider window finds cap-respecting alternatives.
_WINDOW = 4
_OFFSETS = np.arange(-_WINDOW, _WINDOW)
# Up to this many (item of H) x (other item) pairs, all partners are searched at once.
_DENSE_LIMIT = 32_768


def _best_exchange(
    w: np.ndarray,
    tok: np.ndarray | None,
    idx_h: np.ndarray,
    idx_p: np.ndarray,
    gap: float,
    room_h: float,
    room_p: float,
    allow_move: bool,
    eps: float,
) -> tuple[float, int, int] | None:
    """Best (score, i, j) exchange from H to one lighter P; j == -1 means move i from H to P.

    Score: distance of the moved weight from ``gap / 2``. ``room_*``: token slack of each side.
    """
    target = gap / 2.0
    w_h = w[idx_h]
    best: tuple[float, int, int] | None = None
    if allow_move and len(idx_h) > 1:
        ok = (w_h > eps) & (w_h < gap - eps)
        if tok is not None:
            ok &= tok[idx_h] <= room_p
        if ok.any():
            score = np.where(ok, np.abs(w_h - target), np.inf)
            a = int(np.argmin(score))
            best = (float(score[a]), int(idx_h[a]), -1)
    if len(idx_p):
        idx_p = idx_p[np.argsort(w[idx_p], kind="stable")]
        w_p = w[idx_p]
        pos = np.searchsorted(w_p, w_h - target)[:, None] + _OFFSETS[None, :]
        in_range = (pos >= 0) & (pos < len(idx_p))
        cand = idx_p.take(pos, mode="clip")
        delta = w_h[:, None] - w[cand]
        ok = in_range & (delta > eps) & (delta < gap - eps)
        if tok is not None:
            dt = tok[idx_h][:, None] - tok[cand]  # tokens leaving H, entering P
            ok &= (dt <= room_p) & (-dt <= room_h)
        if ok.any():
            score = np.where(ok, np.abs(delta - target), np.inf)
            a, b = divmod(int(np.argmin(score)), score.shape[1])
            if best is None or score[a, b] < best[0]:
                best = (float(score[a, b]), int(idx_h[a]), int(cand[a, b]))
    return best


class _State(NamedTuple):
    """What an exchange search reads: weights, tokens (or None), each item's partition, partition
    sums and token slack, whether single moves are allowed, and the tolerance."""

    w: np.ndarray
    tok: np.ndarray | None
    bin_of: np.ndarray
    sums: np.ndarray
    room: np.ndarray
    allow_move: bool
    eps: float


def _best_exchange_dense(state: _State, h: int) -> tuple[int, int, int] | None:
    """Over every partner at once (small inputs): the exchange with the lowest resulting
    ``max(sum(H), sum(P))``, as (partner, i, j) with j == -1 for a move."""
    w, tok, bin_of, sums, room, allow_move, eps = state
    idx_h = np.flatnonzero(bin_of == h)
    idx_o = np.flatnonzero(bin_of != h)
    top = sums[h]
    best_score, best = np.inf, None
    if allow_move and len(idx_h) > 1:
        delta = w[idx_h][:, None]
        gap = (top - sums)[None, :]
        ok = (delta > eps) & (delta < gap - eps)
        ok[:, h] = False
        if tok is not None:
            ok &= tok[idx_h][:, None] <= room[None, :]
        if ok.any():
            score = np.where(ok, np.maximum(top - delta, sums[None, :] + delta), np.inf)
            a, p = divmod(int(np.argmin(score)), score.shape[1])
            best_score, best = score[a, p], (p, int(idx_h[a]), -1)
    if len(idx_o):
        dest = bin_of[idx_o]
        delta = w[idx_h][:, None] - w[idx_o][None, :]
        ok = (delta > eps) & (delta < (top - sums[dest])[None, :] - eps)
        if tok is not None:
            dt = tok[idx_h][:, None] - tok[idx_o][None, :]
            ok &= (dt <= room[dest][None, :]) & (-dt <= room[h])
        if ok.any():
            score = np.where(ok, np.maximum(top - delta, sums[dest][None, :] + delta), np.inf)
            a, b = divmod(int(np.argmin(score)), score.shape[1])
            if score[a, b] < best_score:
                best = (int(dest[b]), int(idx_h[a]), int(idx_o[b]))
    return best


def _exchange_by_partner(state: _State, h: int) -> tuple[int, int, int] | None:
    """Large inputs: partners from the lightest up; the first with a valid exchange wins."""
    w, tok, bin_of, sums, room, allow_move, eps = state
    idx_h = np.flatnonzero(bin_of == h)
    for p in np.argsort(sums, kind="stable"):
        p = int(p)
        gap = float(sums[h] - sums[p])
        if gap <= 2 * eps:
            return None
        if p == h:
            continue
        found = _best_exchange(w, tok, idx_h, np.flatnonzero(bin_of == p), gap, room[h], room[p], allow_move, eps)
        if found is not None:
            return p, found[1], found[2]
    return None


def refine_partition(
    weights: Any,
    partitions: Sequence[Sequence[int]],
    keep_sizes: bool = True,
    tokens: Any = None,
    max_tokens: float | None = None,
    max_rounds: int | None = None,
) -> list[list[int]]:
    """Improve ``partitions`` by exchanges with the heaviest one; never increases the max sum.

    ``keep_sizes=True`` allows only swaps (partition sizes unchanged); otherwise single moves out
    of the heaviest partition are allowed too, never leaving it empty. With ``tokens`` and
    ``max_tokens`` no exchange takes a partition's token sum above ``max_tokens`` (the input
    partitions are expected to respect it).
    """
    w = _as_weights(weights)
    n = len(w)
    k = len(partitions)
    validate_partition(partitions, n)
    tok = None
    if tokens is not None:
        if max_tokens is None:
            raise ValueError("refine_partition: tokens given without max_tokens")
        tok = np.asarray(tokens, dtype=np.float64)
        if tok.shape != w.shape:
            raise ValueError(f"refine_partition: tokens shape {tok.shape} != weights shape {w.shape}")
    bin_of = np.empty(n, dtype=np.int64)
    for p, part in enumerate(partitions):
        bin_of[np.asarray(part, dtype=np.int64)] = p
    sums = np.bincount(bin_of, weights=w, minlength=k).astype(np.float64)
    if tok is not None:
        room = float(max_tokens) - np.bincount(bin_of, weights=tok, minlength=k)
    else:
        room = np.full(k, np.inf)
    rounds = max_rounds if max_rounds is not None else 4 * n + 4 * k
    for _ in range(rounds if k > 1 else 0):
        h = int(np.argmax(sums))
        eps = 1e-12 * max(float(sums[h]), 1e-300)
        size_h = int(np.count_nonzero(bin_of == h))
        search = _best_exchange_dense if size_h * (n - size_h) <= _DENSE_LIMIT else _exchange_by_partner
        found = search(_State(w, tok, bin_of, sums, room, not keep_sizes, eps), h)
        if found is None:
            break
        p, i, j = found
        for item, src, dst in ((i, h, p), (j, p, h)):
            if item < 0:
                continue
            bin_of[item] = dst
            sums[src] -= w[item]
            sums[dst] += w[item]
            if tok is not None:
                room[src] += tok[item]
                room[dst] -= tok[item]
    order = np.argsort(bin_of, kind="stable")
    bounds = np.searchsorted(bin_of[order], np.arange(k + 1))
    out = [order[bounds[p] : bounds[p + 1]].tolist() for p in range(k)]
    validate_partition(out, n, k=k)
    return out
