"""Whole-step micro-batch planning across DP ranks, and the lockstep cost model it optimises.

Under FSDP every rank gathers parameters collectively for each micro-batch, so ranks advance
through micro-batches in lockstep: micro-step ``j`` ends when the slowest rank finishes its ``j``-th
micro-batch. The step time is therefore ``sum_j max_r cost[r][j]`` (plus a fixed cost per
micro-step for the parameter all-gather), which is at least ``total cost / dp``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .micro_batch import _plan_dynamic, _tokens_and_cap
from .packing import feasible_packing
from .partition import validate_partition
from .workload import Workload, workload_costs


def lockstep_cost(costs_per_rank: Sequence[Sequence[float]], fixed_cost_per_step: float = 0.0) -> float:
    """``sum over micro-steps j of max over ranks r of costs_per_rank[r][j]``, plus
    ``fixed_cost_per_step`` per micro-step. Every rank must have the same number of micro-steps
    (otherwise the collectives would hang); a mismatch is a ``ValueError``."""
    if len(costs_per_rank) == 0:
        raise ValueError("lockstep_cost needs at least one rank")
    counts = [len(c) for c in costs_per_rank]
    if len(set(counts)) != 1:
        raise ValueError(f"ranks have different micro-batch counts {counts}; lockstep needs equal counts")
    if counts[0] == 0:
        return 0.0
    matrix = np.asarray([np.asarray(c, dtype=np.float64) for c in costs_per_rank])
    return float(matrix.max(axis=0).sum() + fixed_cost_per_step * counts[0])


def _best_lockstep_exchange(
    costs: np.ndarray,
    tokens: np.ndarray,
    bin_of: np.ndarray,
    j: int,
    excess: float,
    slack: np.ndarray,
    room: np.ndarray,
) -> tuple[float, int, int, int]:
    """Best exchange out of bin ``j`` of one rank: (gain, item out, item in or -1, destination bin).

    Moving cost ``delta`` out of bin ``j`` (where this rank leads the others by ``excess``) into bin
    ``d`` (which is ``slack[d]`` below that step's max) changes the lockstep cost by
    ``-min(delta, excess) + max(0, delta - slack[d])``; ``room`` is each bin's token slack.
    """
    inside = np.flatnonzero(bin_of == j)
    outside = np.flatnonzero(bin_of != j)
    best = (0.0, -1, -1, -1)
    if inside.size > 1:
        delta = costs[inside][:, None]
        gain = np.minimum(delta, excess) - np.maximum(0.0, delta - slack[None, :])
        ok = tokens[inside][:, None] <= room[None, :]
        ok[:, j] = False
        gain = np.where(ok & (delta > 0), gain, -np.inf)
        a, d = np.unravel_index(int(np.argmax(gain)), gain.shape)
        if gain[a, d] > best[0]:
            best = (float(gain[a, d]), int(inside[a]), -1, int(d))
    if outside.size:
        dest = bin_of[outside]
        delta = costs[inside][:, None] - costs[outside][None, :]
        gain = np.minimum(delta, excess) - np.maximum(0.0, delta - slack[dest][None, :])
        dt = tokens[inside][:, None] - tokens[outside][None, :]  # tokens that enter the other bin
        ok = (delta > 0) & (dt <= room[dest][None, :]) & (-dt <= room[j])
        gain = np.where(ok, gain, -np.inf)
        a, b = np.unravel_index(int(np.argmax(gain)), gain.shape)
        if gain[a, b] > best[0]:
            best = (float(gain[a, b]), int(inside[a]), int(outside[b]), int(dest[b]))
    return best


def refine_lockstep(
    costs_per_rank: Sequence[np.ndarray],
    tokens_per_rank: Sequence[np.ndarray],
    plan: list[list[np.ndarray]],
    max_tokens: int,
    max_rounds: int | None = None,
) -> list[list[np.ndarray]]:
    """Lower ``sum_j max_r cost[r][j]`` by exchanges inside one rank between the micro-batch where it
    alone is the slowest and micro-batches with slack below their step's max.

    Every accepted exchange strictly lowers the lockstep cost and keeps every token sum under the
    cap and every micro-batch non-empty; micro-step ``j`` stays micro-step ``j`` on every rank.
    """
    dp, m = len(plan), len(plan[0])
    if dp < 2 or m < 2:
        return plan
    bin_of = []
    for r, rank in enumerate(plan):
        owner = np.empty(len(costs_per_rank[r]), dtype=np.int64)
        for j, mb in enumerate(rank):
            owner[mb] = j
        bin_of.append(owner)
    cost = np.array([[costs_per_rank[r][mb].sum() for mb in rank] for r, rank in enumerate(plan)])
    tok = np.array([[tokens_per_rank[r][mb].sum() for mb in rank] for r, rank in enumerate(plan)], dtype=np.float64)
    tol = 1e-9 * float(cost.max(initial=0.0))
    rounds = max_rounds if max_rounds is not None else 8 * dp * m
    for _ in range(rounds):
        top = np.argmax(cost, axis=0)
        peak = cost[top, np.arange(m)]
        second = np.partition(cost, dp - 2, axis=0)[dp - 2]
        excess = peak - second
        applied = False
        for j in np.argsort(-excess, kind="stable"):
            if excess[j] <= tol:
                break
            r = int(top[j])
            gain, i, o, d = _best_lockstep_exchange(
                costs_per_rank[r], tokens_per_rank[r], bin_of[r], int(j), float(excess[j]),
                peak - cost[r], max_tokens - tok[r],
            )
            if gain <= tol:
                continue
            c, t = costs_per_rank[r], tokens_per_rank[r]
            bin_of[r][i] = d
            cost[r, j] -= c[i]; cost[r, d] += c[i]; tok[r, j] -= t[i]; tok[r, d] += t[i]  # noqa: E702
            if o >= 0:
                bin_of[r][o] = j
                cost[r, d] -= c[o]; cost[r, j] += c[o]; tok[r, d] -= t[o]; tok[r, j] += t[o]  # noqa: E702
            applied = True
            break
        if not applied:
            break
    return [[np.flatnonzero(bin_of[r] == j) for j in range(m)] for r in range(dp)]


# Work refine_lockstep_across_ranks may spend by default: per step examined, a fixed charge for its
# bookkeeping plus the (sample, partner) pairs scored. A count rather than a clock keeps the result
# deterministic; this one bounds the refinement to about a fifth of a CPU-second on a 2-core box
# (long-context steps at N=4096 to 8192 reach it; the others converge before it).
CROSS_RANK_WORK = 15_000_000
_STEP_CHARGE = 4_000
# A pass of swaps that lowers the lockstep cost by less than this fraction ends the refinement: on
# steps already within a hair of the bound, further passes would cost time for nothing measurable.
_MIN_PASS_GAIN = 1e-5
# Partners scored per sample of the slowest micro-batch: this many on each side of the ideal
# partner cost in cost order. Scoring every sample instead found slightly better swaps per step on
# the benchmark's long-context cases but at several times the time per step, so fewer steps within
# the work budget and a worse plan at N=8192; 16 per side was worse at N=4096.
_PARTNER_WINDOW = 32


def _best_cross_rank_swap(
    costs: np.ndarray,
    tokens: np.ndarray,
    bin_of: np.ndarray,
    inside: np.ndarray,
    by_cost: np.ndarray,
    sorted_costs: np.ndarray,
    step_cost: np.ndarray,
    bin_tokens: np.ndarray,
    peaks: np.ndarray,
    j: int,
    excess: float,
    max_tokens: int,
    tol: float,
) -> tuple[float, int, int, int]:
    """Best swap of a sample of step ``j``'s slowest micro-batch (its samples: ``inside``) with a
    cheaper sample of any other micro-batch: (gain, sample out, sample in, pairs scored).

    ``step_cost``/``bin_tokens``: per micro-batch ``r * m + j``; ``peaks``: each step's max;
    ``by_cost``: the samples in increasing cost order (``sorted_costs`` their costs). Swapping in a
    partner ``delta`` cheaper from a micro-batch of another step, ``slack`` below that step's max,
    changes the lockstep cost by ``-min(delta, excess) + max(0, delta - slack)``, so the ideal
    partner is ``excess`` cheaper; only the ``_PARTNER_WINDOW`` samples on each side of it in cost
    order are scored. From another rank's micro-batch of step ``j`` itself, the step's new max is at
    most ``max(peak - delta, second, other + delta)``.
    """
    m = len(peaks)
    b = int(bin_of[inside[0]])
    c_in, t_in = costs[inside], tokens[inside]
    cheaper = np.searchsorted(sorted_costs, c_in, "left")  # positions below it: strictly cheaper
    ideal = np.searchsorted(sorted_costs, c_in - excess, "left")
    pos = ideal[:, None] + np.arange(-_PARTNER_WINDOW, _PARTNER_WINDOW)[None, :]
    valid = (pos >= 0) & (pos < cheaper[:, None])
    partner = by_cost.take(pos, mode="clip")
    dest = bin_of[partner]
    slack = peaks[dest % m] - step_cost[dest]
    delta = c_in[:, None] - costs[partner]
    moved = t_in[:, None] - tokens[partner]  # tokens that enter the partner's micro-batch
    gain = np.where(
        dest % m == j,
        np.minimum(np.minimum(delta, excess), slack - delta),
        np.minimum(delta, excess) - np.maximum(0.0, delta - slack),
    )
    ok = valid & (dest != b) & (delta > tol)
    ok &= (moved <= max_tokens - bin_tokens[dest]) & (-moved <= max_tokens - bin_tokens[b])
    gain = np.where(ok, gain, -np.inf)
    a, o = divmod(int(np.argmax(gain)), gain.shape[1])
    return float(gain[a, o]), int(inside[a]), int(partner[a, o]), gain.size


def _bin_of(plan: Sequence[Sequence[np.ndarray]], n: int, m: int) -> np.ndarray:
    """Micro-batch ``r * m + j`` of every sample (-1 for samples in no micro-batch)."""
    bin_of = np.full(n, -1, dtype=np.int64)
    for r, rank in enumerate(plan):
        for j, mb in enumerate(rank):
            bin_of[np.asarray(mb, dtype=np.int64)] = r * m + j
    return bin_of


def refine_lockstep_across_ranks(
    costs: np.ndarray,
    tokens: np.ndarray,
    plan: Sequence[Sequence[np.ndarray]],
    max_tokens: int,
    max_work: int = CROSS_RANK_WORK,
) -> list[list[np.ndarray]]:
    """Lower ``sum_j max_r cost[r][j]`` by swapping one sample of a step's slowest micro-batch with
    one cheaper sample of any other micro-batch, of the same rank or of another one.

    ``plan[r][j]``: indices into the global ``costs``/``tokens`` of rank ``r``'s ``j``-th
    micro-batch. Each pass visits the steps by decreasing lead of their slowest micro-batch over the
    second slowest and applies, per step, the best swap found (:func:`_best_cross_rank_swap`). Every
    swap strictly lowers the lockstep cost and keeps every micro-batch non-empty and within
    ``max_tokens``, every rank's sample count and micro-step ``j`` as ``j``. Passes stop when one
    gains less than a 1e-5 fraction or after about ``max_work`` units of work (deterministic).
    """
    dp = len(plan)
    m = len(plan[0]) if dp else 0
    if any(len(rank) != m for rank in plan):
        raise ValueError(f"ranks have different micro-batch counts {[len(rank) for rank in plan]}")
    costs = np.asarray(costs, dtype=np.float64)
    tokens = np.asarray(tokens, dtype=np.float64)
    bin_of = _bin_of(plan, len(costs), m)
    members = np.flatnonzero(bin_of >= 0)
    step_cost = np.bincount(bin_of[members], weights=costs[members], minlength=dp * m)
    bin_tokens = np.bincount(bin_of[members], weights=tokens[members], minlength=dp * m)
    grid = step_cost.reshape(dp, m)  # a view: the updates to step_cost show in it
    tol = 1e-9 * float(step_cost.max(initial=0.0))
    by_cost = members[np.argsort(costs[members], kind="stable")]
    sorted_costs = costs[by_cost]
    work = 0
    while dp > 1 and m > 0 and work < max_work:
        pass_gain = 0.0
        lead = grid.max(axis=0) - np.partition(grid, dp - 2, axis=0)[dp - 2]
        for j in np.argsort(-lead, kind="stable").tolist():
            if work >= max_work:
                break
            column = grid[:, j]
            r = int(np.argmax(column))
            excess = float(column[r] - np.partition(column, dp - 2)[dp - 2])  # earlier swaps moved it
            if excess <= tol:
                continue
            gain, i, o, pairs = _best_cross_rank_swap(
                costs, tokens, bin_of, np.flatnonzero(bin_of == r * m + j), by_cost, sorted_costs,
                step_cost, bin_tokens, grid.max(axis=0), j, excess, max_tokens, tol,
            )
            work += _STEP_CHARGE + pairs
            if gain <= tol:
                continue
            b, d = r * m + j, int(bin_of[o])
            step_cost[b] += costs[o] - costs[i]; step_cost[d] += costs[i] - costs[o]  # noqa: E702
            bin_tokens[b] += tokens[o] - tokens[i]; bin_tokens[d] += tokens[i] - tokens[o]  # noqa: E702
            bin_of[i], bin_of[o] = d, b
            pass_gain += gain
        if pass_gain <= _MIN_PASS_GAIN * float(grid.max(axis=0).sum()):
            break
    order = members[np.argsort(bin_of[members], kind="stable")]
    bounds = np.searchsorted(bin_of[order], np.arange(dp * m + 1))
    return [[order[bounds[r * m + j]: bounds[r * m + j + 1]] for j in range(m)] for r in range(dp)]


def plan_joint_micro_batches(
    lengths_per_rank: Sequence[Sequence[int] | np.ndarray],
    max_tokens: int,
    workload: Workload = "tokens",
    num_micro_batches: int | None = None,
) -> list[list[np.ndarray]]:
    """Micro-batches for every DP rank of one step: the same count on every rank, each under the
    token cap, non-empty, and the j-th micro-batches of all ranks of similar cost.

    Returns ``plan[r][j]``: rank-local sample indices (ascending) of rank ``r``'s ``j``-th
    micro-batch; micro-steps are ordered by decreasing cost of their slowest rank. The count is the
    largest :func:`min_micro_batches` over ranks (or ``num_micro_batches`` if larger). Each rank is
    balanced on its own, then :func:`refine_lockstep` evens out the micro-steps across ranks.
    """
    if len(lengths_per_rank) == 0:
        raise ValueError("plan_joint_micro_batches needs at least one rank")
    tokens = [_tokens_and_cap(lengths, max_tokens) for lengths in lengths_per_rank]
    costs = [workload_costs(t, workload) for t in tokens]
    bases = [feasible_packing(t, max_tokens) for t in tokens]
    needed = [len(b) for b in bases]
    k = max(needed)
    if num_micro_batches is not None:
        if num_micro_batches < k:
            raise ValueError(
                f"num_micro_batches={num_micro_batches} is below the {k} micro-batches rank "
                f"{int(np.argmax(needed))} needs under max_tokens={max_tokens}"
            )
        k = num_micro_batches
    sizes = [len(t) for t in tokens]
    if k > min(sizes):
        r = int(np.argmin(sizes))
        raise ValueError(
            f"every rank needs {k} micro-batches (rank {int(np.argmax(needed))} needs {max(needed)} under "
            f"max_tokens={max_tokens}), but rank {r} has only {sizes[r]} samples; micro-batches may not be empty"
        )
    if k == 0:
        return [[] for _ in tokens]
    plan = [_plan_dynamic(t, c, max_tokens, k, b) for t, c, b in zip(tokens, costs, bases)]
    plan = refine_lockstep(costs, tokens, plan, max_tokens)
    step_cost = np.array([[c[mb].sum() for mb in rank] for c, rank in zip(costs, plan)]).max(axis=0)
    steps = sorted(range(k), key=lambda j: -step_cost[j])
    for r, rank in enumerate(plan):
        validate_partition(rank, sizes[r], k=k, allow_empty=False)
        assert all(tokens[r][mb].sum() <= max_tokens for mb in rank), "joint plan broke the token cap"
    return [[rank[j] for j in steps] for rank in plan]
