"""One training step's (or mini-batch's) whole batch plan: which samples each DP rank runs, cut
into micro-batches in execution order, chosen for what the step will wait on.

:func:`plan_step` is the single entry point the trainer and the benchmark use. Every plan it makes
is a DP partition (equal sample counts per rank) followed by micro-batches under a hard token cap,
the same count on every rank. What it minimises is its ``objective`` (:class:`PlanObjective`), which
follows how the engine synchronises the ranks:

* ``"lockstep"``: collectives in every micro-batch (FSDP2 all-gathers the parameters in each, and
  on GPU reduce-scatters the gradients after each backward), so micro-step ``j`` ends when the slowest rank ends
  its ``j``-th micro-batch and the step costs ``sum_j max_r cost[r][j]`` (:mod:`ballast.balance.joint`);
* ``"rank_total"``: one gradient synchronisation per mini-batch (DDP whole replicas, which
  accumulate under ``no_sync``) or none at all (a frozen replica's log-prob pass): ranks run their
  micro-batches independently and the step waits on the slowest rank's total, ``max_r sum_j
  cost[r][j]``.

Lockstep candidates (the cheapest by lockstep cost is kept):

* ``joint``: the workload-balanced DP partition (:func:`balance_batch`), then
  :func:`plan_joint_micro_batches` (each rank balanced under the cap, then lockstep exchanges);
* ``kk_verl_dp``: a Karmarkar-Karp DP partition on the ``"verl"`` cost ``24576 L + L^2`` (which
  lines up the micro-steps better when a rank holds only a few long samples), then the joint
  micro-batches on it;
* ``*_kk_micro``: either DP partition, then per-rank Karmarkar-Karp micro-batches with the count
  grown from ``ceil(tokens / cap)`` until every rank fits (the classic dynamic-batch recipe),
  aligned by cost and refined by the same lockstep exchanges.

The alternatives are built only for ranks of at most 32 samples (see
``_ALTERNATIVES_MAX_SAMPLES_PER_RANK``); larger mini-batches get the joint plan alone. The kept plan
is then refined by swaps of single samples between any two micro-batches, across ranks too
(:func:`refine_lockstep_across_ranks`; skipped when GRPO groups must stay on one rank), which only
ever lowers its cost; its candidate name then ends in ``+cross_rank``.

Rank-total candidates are DP partitions compared by their heaviest rank: the workload-balanced one
(:func:`balance_batch`: Karmarkar-Karp and greedy on the workload costs, equal sizes, refined by
swaps) and verl's (Karmarkar-Karp on the ``"verl"`` cost, equal sizes, or on uid groups' costs when
groups are kept) refined by swaps on the workload costs (``kk_verl_dp_refined``), so the heaviest
rank is never heavier than under verl's partition, whichever cost model the plan is given. The
micro-batches inside each rank then only have to respect the cap with equal counts; among the
partitions of the lightest heaviest rank (ties) and the micro-batch candidates above, the lowest
lockstep cost wins, which never moves a sample to another rank. No swaps across ranks.

Whichever objective chose it, a :class:`StepPlan` reports both figures and their lower bounds
(:func:`lockstep_lower_bounds`; for the rank total, the rank holding the costliest sample).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Iterator, Sequence

import numpy as np

from .dp_balance import balance_batch
from .joint import lockstep_cost, plan_joint_micro_batches, refine_lockstep, refine_lockstep_across_ranks
from .micro_batch import _tokens_and_cap
from .partition import karmarkar_karp, validate_partition
from .refine import refine_partition
from .workload import Workload, workload_costs

# How many times the per-rank Karmarkar-Karp candidate may grow its count before it is dropped.
_KK_MAX_GROWTH = 2
# The alternative candidates are built only when ranks hold at most this many samples: there a few
# long samples decide each micro-step and the choice of partition matters; with many samples per
# rank the joint plan is already within a fraction of a percent of the bound, and the extra
# candidates would double the planning time the driver spends every mini-batch.
_ALTERNATIVES_MAX_SAMPLES_PER_RANK = 32
# Heaviest ranks within this relative distance count as equal (float rounding of the same sums).
_RANK_TOTAL_TIE = 1e-12


class PlanObjective(str, enum.Enum):
    """What one step waits on, set by how the engine synchronises its data-parallel ranks.

    ``LOCKSTEP``: collectives in every micro-batch (FSDP2): ``sum_j max_r cost[r][j]``.
    ``RANK_TOTAL``: one gradient sync per mini-batch, or none (DDP replicas, frozen replicas):
    ``max_r sum_j cost[r][j]``.
    """

    LOCKSTEP = "lockstep"
    RANK_TOTAL = "rank_total"


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """``micro_batches[r][j]``: global sample indices of rank ``r``'s ``j``-th micro-batch (execution
    order; the same count on every rank). ``partitions[r]`` is their concatenation, so sending
    ``batch[order]`` in ``dp`` contiguous equal chunks gives rank ``r`` its samples with micro-batch
    ``j`` at the rows :meth:`local_micro_batches` names.

    Both figures are reported whichever ``objective`` chose the plan: ``lockstep_cost`` (``sum_j
    max_r``) with ``attainable_lower_bound`` below it, and ``max_rank_total`` (``max_r sum_j``) with
    ``rank_total_lower_bound`` below it; ``lower_bound`` (``total / dp``) is below both."""

    micro_batches: list[list[np.ndarray]]
    objective: PlanObjective
    candidate: str
    lockstep_cost: float
    max_rank_total: float
    lower_bound: float
    attainable_lower_bound: float
    rank_total_lower_bound: float

    @property
    def dp_size(self) -> int:
        return len(self.micro_batches)

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches[0]) if self.micro_batches else 0

    @property
    def partitions(self) -> list[np.ndarray]:
        return [np.concatenate(rank) if rank else np.zeros(0, dtype=np.int64) for rank in self.micro_batches]

    @property
    def order(self) -> np.ndarray:
        parts = self.partitions
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def local_micro_batches(self) -> list[list[np.ndarray]]:
        """``[r][j]``: row positions of micro-batch ``j`` inside rank ``r``'s chunk of ``batch[order]``."""
        out = []
        for rank in self.micro_batches:
            bounds = np.cumsum([0] + [len(mb) for mb in rank])
            out.append([np.arange(bounds[j], bounds[j + 1], dtype=np.int64) for j in range(len(rank))])
        return out


def _heaviest_rank_bound(costs: np.ndarray, per_rank: int) -> float:
    """The rank holding the costliest sample runs at least it and the ``per_rank - 1`` cheapest others."""
    top = int(np.argmax(costs))
    others = np.delete(costs, top)
    return float(costs[top] + np.sort(others)[: per_rank - 1].sum())


def lockstep_lower_bounds(
    lengths: Sequence[int] | np.ndarray, dp: int, max_tokens: int, workload: Workload = "tokens"
) -> tuple[float, float]:
    """(``total / dp``, an attainable-side bound >= it) on the lockstep cost of any plan with equal
    sample counts per rank and micro-batches of <= ``max_tokens`` tokens.

    The second is the largest of: ``total / dp``; the rank holding the costliest sample (it runs at
    least that sample plus the ``N/dp - 1`` cheapest others); and the sum of micro-step maxima. For
    the last, sort samples by decreasing cost: a micro-step holds at most ``dp * max_tokens`` tokens,
    so if the ``t``-th costliest micro-step maximum were below the sample that starts the ``t``-th
    chunk of ``dp * max_tokens`` tokens of that order, the costlier samples (more than ``t - 1``
    steps' worth of tokens) would all fit in ``t - 1`` steps. Costs must grow with length.
    """
    tokens = _tokens_and_cap(lengths, max_tokens)
    costs = workload_costs(tokens, workload)
    n = len(costs)
    if n == 0:
        return 0.0, 0.0
    perfect = float(costs.sum()) / dp
    by_cost = np.lexsort((-tokens, -costs))
    sorted_costs = costs[by_cost]
    rank_bound = _heaviest_rank_bound(costs, n // dp)
    prefix = np.cumsum(tokens[by_cost])
    step_capacity = dp * max_tokens
    # Sample s starts chunk t+1 when prefix[s] > t * capacity >= prefix[s-1].
    chunk = np.maximum(prefix - 1, 0) // step_capacity
    starts = np.flatnonzero(np.diff(np.concatenate([[-1], chunk])) > 0)
    step_bound = float(sorted_costs[starts].sum())
    return perfect, max(perfect, rank_bound, step_bound)


def _align_and_refine(costs: list[np.ndarray], tokens: list[np.ndarray], plan: list[list[np.ndarray]],
                      max_tokens: int) -> list[list[np.ndarray]]:
    """Each rank's micro-batches sorted by decreasing cost (aligns the j-th heaviest of every rank,
    which never raises the lockstep cost), lockstep exchanges, then steps by decreasing cost."""
    plan = [sorted(rank, key=lambda mb, c=c: (-float(c[mb].sum()), int(mb.min()))) for c, rank in zip(costs, plan)]
    plan = refine_lockstep(costs, tokens, plan, max_tokens)
    step_cost = np.array([[c[mb].sum() for mb in rank] for c, rank in zip(costs, plan)]).max(axis=0)
    steps = sorted(range(len(plan[0])), key=lambda j: -step_cost[j])
    return [[rank[j] for j in steps] for rank in plan]


def _refine_across_ranks(costs: np.ndarray, tokens: np.ndarray, micro: list[list[np.ndarray]],
                         max_tokens: int) -> list[list[np.ndarray]]:
    """Swaps across ranks (:func:`refine_lockstep_across_ranks`), then steps by decreasing cost."""
    micro = refine_lockstep_across_ranks(costs, tokens, micro, max_tokens)
    step_cost = np.array([[costs[mb].sum() for mb in rank] for rank in micro]).max(axis=0)
    steps = sorted(range(len(micro[0])), key=lambda j: -step_cost[j])
    return [[rank[j] for j in steps] for rank in micro]


def _kk_micro(tokens: list[np.ndarray], max_tokens: int) -> list[list[np.ndarray]] | None:
    """Per-rank Karmarkar-Karp on ``"verl"`` costs, the count grown until every rank fits the cap."""
    k = max(min(len(t), math.ceil(int(t.sum()) / max_tokens)) for t in tokens)
    verl_costs = [workload_costs(t, "verl") for t in tokens]
    fewest = min(len(t) for t in tokens)
    heaviest_first = sorted(range(len(tokens)), key=lambda r: -int(tokens[r].sum()))
    for k in range(max(k, 1), min(fewest, k + _KK_MAX_GROWTH) + 1):
        plan: list = [None] * len(tokens)
        for r in heaviest_first:  # the heaviest rank is the likeliest to break the cap: stop early
            rank = [np.asarray(p, dtype=np.int64) for p in karmarkar_karp(verl_costs[r], k)]
            if not all(len(mb) and tokens[r][mb].sum() <= max_tokens for mb in rank):
                break
            plan[r] = rank
        else:
            return plan
    return None


def _micro_candidates(name: str, parts: list[np.ndarray], tokens: np.ndarray, costs: np.ndarray,
                      max_tokens: int, workload: Workload, alternatives: bool):
    """(candidate, micro_batches[r][j] in global indices, lockstep cost) for one DP partition: the
    joint micro-batches and, with ``alternatives``, per-rank Karmarkar-Karp ones. Ranks keep their samples."""
    rank_tokens = [tokens[p] for p in parts]
    rank_costs = [costs[p] for p in parts]
    local_plans = {name: plan_joint_micro_batches(rank_tokens, max_tokens, workload=workload)}
    kk = _kk_micro(rank_tokens, max_tokens) if alternatives else None
    if kk is not None:
        local_plans[f"{name}_kk_micro"] = _align_and_refine(rank_costs, rank_tokens, kk, max_tokens)
    for cand, local in local_plans.items():
        cost = lockstep_cost([[float(c[mb].sum()) for mb in rank] for c, rank in zip(rank_costs, local)])
        yield cand, [[np.asarray(p)[mb] for mb in rank] for p, rank in zip(parts, local)], cost


def _lockstep_partitions(tokens: np.ndarray, dp: int, workload: Workload, group_ids: Any, alternatives: bool):
    yield "joint", balance_batch(tokens, dp, workload=workload, group_ids=group_ids).partitions
    if not alternatives:
        return
    if group_ids is None:
        parts = karmarkar_karp(workload_costs(tokens, "verl"), dp, equal_size=True)
        yield "kk_verl_dp", [np.asarray(p, dtype=np.int64) for p in parts]
    elif workload != "verl":
        yield "kk_verl_dp", balance_batch(tokens, dp, workload="verl", group_ids=group_ids).partitions


def _plan_lockstep(tokens: np.ndarray, costs: np.ndarray, dp: int, max_tokens: int, workload: Workload,
                   group_ids: Any) -> tuple[str, list[list[np.ndarray]]]:
    """The candidate of the lowest lockstep cost, then swaps across ranks unless groups are kept."""
    best: tuple[float, str, list[list[np.ndarray]]] | None = None
    alternatives = len(tokens) // dp <= _ALTERNATIVES_MAX_SAMPLES_PER_RANK
    for name, parts in _lockstep_partitions(tokens, dp, workload, group_ids, alternatives):
        for cand, micro, cost in _micro_candidates(name, parts, tokens, costs, max_tokens, workload, alternatives):
            if best is None or cost < best[0]:
                best = (cost, cand, micro)
    assert best is not None
    cost, cand, micro = best
    if group_ids is None and dp > 1:
        micro = _refine_across_ranks(costs, tokens, micro, max_tokens)
        refined = lockstep_cost([[float(costs[mb].sum()) for mb in rank] for rank in micro])
        if refined < cost:
            cand = f"{cand}+cross_rank"
    return cand, micro


def _refined_on_costs(costs: np.ndarray, parts: Sequence[np.ndarray], group_ids: Any, dp: int) -> list[np.ndarray]:
    """``parts`` improved by swaps (of samples, or of whole uid groups) on ``costs``, never raising
    the heaviest rank; every rank keeps ``N / dp`` samples."""
    if group_ids is None:
        return [np.asarray(p, dtype=np.int64) for p in refine_partition(costs, parts, keep_sizes=True)]
    _, group_of = np.unique(np.asarray(group_ids), return_inverse=True)
    group_of = group_of.reshape(-1)
    group_costs = np.bincount(group_of, weights=costs)
    sizes = np.bincount(group_of)
    group_parts = [np.unique(group_of[np.asarray(p, dtype=np.int64)]) for p in parts]
    # Swaps of unequal groups are held to N / dp samples per rank: with the total fixed, sizes stay equal.
    refined = refine_partition(group_costs, group_parts, keep_sizes=True, tokens=sizes, max_tokens=len(costs) // dp)
    return [np.flatnonzero(np.isin(group_of, gp)) for gp in refined]


def _rank_total_partitions(tokens: np.ndarray, costs: np.ndarray, dp: int, workload: Workload,
                           group_ids: Any) -> Iterator[tuple[str, list[np.ndarray]]]:
    """The workload-balanced partition, and verl's (Karmarkar-Karp on its cost, on samples or on uid
    groups) refined on the workload costs: never a heavier heaviest rank than verl's own."""
    yield "joint", balance_batch(tokens, dp, workload=workload, group_ids=group_ids).partitions
    if isinstance(workload, str) and workload == "verl":
        return  # balance_batch refined verl's own Karmarkar-Karp start on these very costs
    if group_ids is None:
        verl_parts = karmarkar_karp(workload_costs(tokens, "verl"), dp, equal_size=True)
    else:
        verl_parts = balance_batch(tokens, dp, workload="verl", group_ids=group_ids).partitions
    yield "kk_verl_dp_refined", _refined_on_costs(costs, verl_parts, group_ids, dp)


def _plan_rank_total(tokens: np.ndarray, costs: np.ndarray, dp: int, max_tokens: int, workload: Workload,
                     group_ids: Any) -> tuple[str, list[list[np.ndarray]]]:
    """The partition with the lightest heaviest rank; among ties, the micro-batches of lowest lockstep cost."""
    partitions = list(_rank_total_partitions(tokens, costs, dp, workload, group_ids))
    heaviest = [max(float(costs[p].sum()) for p in parts) for _, parts in partitions]
    lightest = min(heaviest)
    alternatives = len(tokens) // dp <= _ALTERNATIVES_MAX_SAMPLES_PER_RANK
    best: tuple[float, str, list[list[np.ndarray]]] | None = None
    for (name, parts), top in zip(partitions, heaviest):
        if top > lightest * (1 + _RANK_TOTAL_TIE):
            continue
        for cand, micro, cost in _micro_candidates(name, parts, tokens, costs, max_tokens, workload, alternatives):
            if best is None or cost < best[0]:
                best = (cost, cand, micro)
    assert best is not None
    return best[1], best[2]


def _as_objective(objective: PlanObjective | str) -> PlanObjective:
    try:
        return PlanObjective(objective)
    except ValueError:
        allowed = ", ".join(repr(o.value) for o in PlanObjective)
        raise ValueError(f"objective must be one of {allowed}, got {objective!r}") from None


def plan_step(
    lengths: Sequence[int] | np.ndarray,
    dp: int,
    max_tokens: int,
    workload: Workload = "tokens",
    group_ids: Sequence[Any] | np.ndarray | None = None,
    objective: PlanObjective | str = PlanObjective.LOCKSTEP,
) -> StepPlan:
    """Plan one mini-batch for ``dp`` ranks: equal sample counts, equal micro-batch counts, every
    micro-batch non-empty and within ``max_tokens`` tokens, best under ``objective`` of the candidates.

    ``lengths``: prompt + response tokens per sample; ``workload``: the cost model; ``group_ids``:
    samples sharing an id (a GRPO prompt's responses) stay on one rank; ``objective``: ``"lockstep"``
    (per-micro-batch collectives, FSDP2) or ``"rank_total"`` (one gradient sync per mini-batch or
    none: DDP or frozen replicas). Deterministic.
    """
    objective = _as_objective(objective)
    tokens = _tokens_and_cap(lengths, max_tokens)
    n = len(tokens)
    if isinstance(dp, bool) or not isinstance(dp, (int, np.integer)) or dp < 1:
        raise ValueError(f"dp must be a positive integer, got {dp!r}")
    if n == 0 or n % dp:
        raise ValueError(f"plan_step needs a positive number of samples divisible by dp={dp}, got N={n}")
    costs = workload_costs(tokens, workload)
    planner = _plan_lockstep if objective is PlanObjective.LOCKSTEP else _plan_rank_total
    cand, micro = planner(tokens, costs, dp, max_tokens, workload, group_ids)
    for rank in micro:
        assert all(tokens[mb].sum() <= max_tokens and len(mb) for mb in rank), "plan broke the cap"
    assert len({len(rank) for rank in micro}) == 1, "ranks got different micro-batch counts"
    validate_partition([mb for rank in micro for mb in rank], n)
    grid = [[float(costs[mb].sum()) for mb in rank] for rank in micro]
    perfect, attainable = lockstep_lower_bounds(tokens, dp, max_tokens, workload)
    return StepPlan(
        micro_batches=micro, objective=objective, candidate=cand, lockstep_cost=lockstep_cost(grid),
        max_rank_total=max(sum(rank) for rank in grid), lower_bound=perfect, attainable_lower_bound=attainable,
        rank_total_lower_bound=max(perfect, _heaviest_rank_bound(costs, n // dp)),
    )
