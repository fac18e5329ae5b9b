"""Local refinement of a partition: exchanges between the heaviest partition and lighter ones.

Each accepted exchange (a swap of one item each way, or, when sizes may change, a single move out
of the heaviest partition) moves a weight ``delta`` with ``0 < delta < gap`` between the heaviest
partition ``H`` and a lighter one ``P`` (``gap = sum(H) - sum(P)``), so both new sums stay strictly
below the old ``sum(H)``: the maximum never increases, and the sum of squared partition sums strictly
decreases, so the search terminates. Among the valid exchanges the one closest to ``gap / 2`` is
taken. An optional second quantity (tokens) may be held under a cap by every exchange.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .partition import _as_weights, validate_partition

# Candidates examined on each side of the ideal partner weight in the sorted lighter partition: with
# no token cap the nearest two are optimal; the wider window finds cap-respecting alternatives.
_WINDOW = 4
_OFFSETS = np.arange(-_WINDOW, _WINDOW)


def _best_exchange(
    w: np.ndarray,
    tok: np.ndarray | None,
    part_h: list[int],
    part_p: list[int],
    gap: float,
    room_h: float,
    room_p: float,
    allow_move: bool,
    eps: float,
) -> tuple[float, int, int] | None:
    """Best (score, i, j) exchange from H to P; j == -1 means move i from H to P.

    ``room_*`` is the token slack of each side (``inf`` without a cap).
    """
    target = gap / 2.0
    idx_h = np.asarray(part_h, dtype=np.int64)
    w_h = w[idx_h]
    best: tuple[float, int, int] | None = None
    if allow_move and len(part_h) > 1:
        ok = (w_h > eps) & (w_h < gap - eps)
        if tok is not None:
            ok &= tok[idx_h] <= room_p
        if ok.any():
            score = np.where(ok, np.abs(w_h - target), np.inf)
            a = int(np.argmin(score))
            best = (float(score[a]), int(idx_h[a]), -1)
    if part_p:
        idx_p = np.asarray(part_p, dtype=np.int64)
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
            flat = int(np.argmin(score))
            a, b = divmod(flat, score.shape[1])
            if best is None or score[a, b] < best[0]:
                best = (float(score[a, b]), int(idx_h[a]), int(cand[a, b]))
    return best


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
    ``max_tokens`` no exchange takes a partition's token sum above ``max_tokens``.
    """
    w = _as_weights(weights)
    n = len(w)
    validate_partition(partitions, n)
    tok = None
    if tokens is not None:
        if max_tokens is None:
            raise ValueError("refine_partition: tokens given without max_tokens")
        tok = np.asarray(tokens, dtype=np.float64)
        if tok.shape != w.shape:
            raise ValueError(f"refine_partition: tokens shape {tok.shape} != weights shape {w.shape}")
    parts = [[int(i) for i in p] for p in partitions]
    k = len(parts)
    sums = np.array([w[p].sum() if p else 0.0 for p in parts])
    tok_sums = np.array([tok[p].sum() if p else 0.0 for p in parts]) if tok is not None else None
    cap = float(max_tokens) if max_tokens is not None else np.inf
    rounds = max_rounds if max_rounds is not None else 4 * n + 4 * k
    for _ in range(rounds):
        h = int(np.argmax(sums))
        eps = 1e-12 * max(float(sums[h]), 1e-300)
        exchange = None
        for p in np.argsort(sums, kind="stable"):
            p = int(p)
            gap = float(sums[h] - sums[p])
            if gap <= 2 * eps:
                break
            if p == h:
                continue
            room_h = cap - tok_sums[h] if tok_sums is not None else np.inf
            room_p = cap - tok_sums[p] if tok_sums is not None else np.inf
            found = _best_exchange(w, tok, parts[h], parts[p], gap, room_h, room_p, not keep_sizes, eps)
            if found is not None:
                exchange = (p, found[1], found[2])
                break
        if exchange is None:
            break
        p, i, j = exchange
        parts[h].remove(i)
        parts[p].append(i)
        sums[h] -= w[i]
        sums[p] += w[i]
        if tok_sums is not None:
            tok_sums[h] -= tok[i]
            tok_sums[p] += tok[i]
        if j >= 0:
            parts[p].remove(j)
            parts[h].append(j)
            sums[p] -= w[j]
            sums[h] += w[j]
            if tok_sums is not None:
                tok_sums[p] -= tok[j]
                tok_sums[h] += tok[j]
    out = [sorted(p) for p in parts]
    validate_partition(out, n, k=k)
    return out
