"""The plan of one phase of a training step, the only way a step's samples reach the engine.

A phase (old log-probs, reference log-probs, values, critic update, actor update) is planned once, on
the driver, by :func:`plan_phase`: which step rows each data-parallel rank holds, the mini-batches of
every epoch, and the micro-batches of each mini-batch, in execution order. Workers and the engine
execute a :class:`PhasePlan`; they never cut, shuffle or re-plan. An engine used alone (one process
per rank, each holding its own rows) gets its plan from the same function with ``partitions=``.

Layout. ``rows`` lists the step-batch row of every dispatched row, rank-major: rank ``r`` receives
``rows[r * n_r : (r + 1) * n_r]`` (the contiguous split of ``batch[rows]``). Inside a rank's chunk,
mini-batch ``m`` is the next ``rows_per_rank[r]`` rows of ``mini_batches[m]``, and
``mini_batches[m].micro_batches[r][j]`` are row positions inside that mini-batch slice. An update
of ``E`` epochs dispatches every sample ``E`` times (once per epoch).

Micro-batch modes (:class:`MicroBatchMode`): ``static`` (chunks of ``micro_batch_size`` rows),
``dynamic`` (a hard cap of ``token_budget`` real tokens per micro-batch, balanced by workload) and
``bucketed`` (dynamic, and a micro-batch never mixes prompt-length buckets). Every rank runs the same
number of micro-batches; an empty micro-batch (only where a rank holds fewer rows than the agreed
count, which the trainer's equal-count layout never produces) is a zero-weight step for the engine.

Shared prompts. With ``shared_prompts`` (a prompt id per row) the rows of one prompt form a unit
that is never split: the plan is made over units (their executed tokens: the prompt once plus every
response) and expanded to rows, and its mini-batches say ``shared_prompts=True`` so that the engine
runs each unit's prompt once (:mod:`ballast.balance.shared_prompts`).

Objective. With balancing on, the DP partition and the micro-batches are chosen for how the engine
synchronises (see :class:`ballast.balance.step_plan.PlanObjective` when passed as ``objective``):
per-micro-batch collectives (FSDP2) wait on the lockstep cost, one gradient sync per mini-batch
(whole replicas) on the slowest rank's total.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Optional, Sequence

import numpy as np

from .bucketing import bucket_ids, check_bucket_boundaries, min_bucketed_micro_batches, plan_bucketed_micro_batches
from .dp_balance import balance_batch
from .micro_batch import inverse_permutation, min_micro_batches, plan_dynamic_micro_batches
from .partition import validate_partition
from .pipeline_cost import PipelineCostModel
from .pipeline_plan import plan_pipeline_micro_batches
from .shared_prompts import PromptUnits, prompt_units, shared_lengths
from .step_plan import plan_step
from .workload import Workload, _as_lengths


class MicroBatchMode(str, enum.Enum):
    STATIC = "static"
    DYNAMIC = "dynamic"
    BUCKETED = "bucketed"


@dataclasses.dataclass(frozen=True)
class MicroBatchPolicy:
    """How a mini-batch is cut on each rank: ``micro_batch_size`` rows (static) or at most
    ``token_budget`` real tokens (dynamic, bucketed: the budget of the rank's whole SP group).
    ``pipeline``: the engine is a pipeline, whose micro-batches travel in fixed slots, in counts and
    an order planned with this cost model (:mod:`ballast.balance.pipeline_plan`; static or dynamic)."""

    mode: MicroBatchMode
    micro_batch_size: Optional[int] = None
    token_budget: Optional[int] = None
    bucket_boundaries: Optional[tuple[int, ...]] = None
    pipeline: Optional[PipelineCostModel] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", MicroBatchMode(self.mode))
        if self.pipeline is not None and self.mode is MicroBatchMode.BUCKETED:
            raise ValueError("bucketed micro-batches do not run through a pipeline engine: use static or dynamic")
        if self.mode is MicroBatchMode.STATIC:
            if not isinstance(self.micro_batch_size, (int, np.integer)) or self.micro_batch_size < 1:
                raise ValueError(f"a static micro-batch policy needs micro_batch_size >= 1, got {self.micro_batch_size!r}")
            return
        if not isinstance(self.token_budget, (int, np.integer)) or self.token_budget < 1:
            raise ValueError(f"a {self.mode.value} micro-batch policy needs token_budget >= 1, got {self.token_budget!r}")
        if (self.mode is MicroBatchMode.BUCKETED) != (self.bucket_boundaries is not None):
            raise ValueError("bucket_boundaries are given exactly when the mode is 'bucketed'")
        if self.bucket_boundaries is not None:
            check_bucket_boundaries(self.bucket_boundaries)


@dataclasses.dataclass(frozen=True, eq=False)
class MiniBatchPlan:
    """``micro_batches[r][j]``: row positions, inside rank ``r``'s slice of this mini-batch, of its
    ``j``-th micro-batch (the same count on every rank; empty = a zero-weight step)."""

    micro_batches: tuple[tuple[np.ndarray, ...], ...]
    token_budget: Optional[int] = None  # the hard cap the engine checks (None: static)
    shared_prompts: bool = False  # rows sharing a prompt run it once (their tokens count it once)
    slot_tokens: Optional[int] = None  # pipeline: every micro-batch travels in exactly this many tokens

    @property
    def dp_size(self) -> int:
        return len(self.micro_batches)

    @property
    def num_micro_batches(self) -> int:
        return len(self.micro_batches[0]) if self.micro_batches else 0

    @property
    def rows_per_rank(self) -> tuple[int, ...]:
        return tuple(int(sum(len(mb) for mb in rank)) for rank in self.micro_batches)

    def for_rank(self, rank: int) -> tuple[np.ndarray, ...]:
        return self.micro_batches[rank]


@dataclasses.dataclass(frozen=True, eq=False)
class PhasePlan:
    """One phase's layout over ``dp_size`` ranks; see the module docstring. ``metrics``: plan quality."""

    rows: np.ndarray
    mini_batches: tuple[MiniBatchPlan, ...]
    policy: MicroBatchPolicy
    epochs: int
    metrics: dict
    objective: Any = None  # what balanced it (None: the planner's default, or no balancing)

    @property
    def dp_size(self) -> int:
        return self.mini_batches[0].dp_size

    def rank_sizes(self) -> tuple[int, ...]:
        """Rows each rank receives (the dispatch chunk sizes)."""
        return tuple(int(v) for v in np.sum([mb.rows_per_rank for mb in self.mini_batches], axis=0))

    def rank_rows(self, rank: int) -> np.ndarray:
        """Step rows of rank ``rank``'s chunk, in dispatch order."""
        bounds = np.cumsum((0,) + self.rank_sizes())
        return self.rows[bounds[rank]:bounds[rank + 1]]

    def partitions(self, mini_batch: int = 0) -> list[np.ndarray]:
        """Step rows that each rank holds in mini-batch ``mini_batch``."""
        out = []
        for r in range(self.dp_size):
            start = sum(mb.rows_per_rank[r] for mb in self.mini_batches[:mini_batch])
            out.append(self.rank_rows(r)[start:start + self.mini_batches[mini_batch].rows_per_rank[r]])
        return out

    def first_mini_batch_rows(self) -> np.ndarray:
        """Step rows trained in the first mini-batch of the first epoch (under the sampling weights)."""
        return np.sort(np.concatenate(self.partitions(0)))

    def restore_index(self) -> np.ndarray:
        """For a one-epoch phase covering every row once: ``outputs[restore_index()]`` (outputs in
        dispatch order) is in step-row order."""
        return inverse_permutation(self.rows)


def plan_phase(
    lengths: Sequence[int] | np.ndarray,
    dp_size: int,
    policy: MicroBatchPolicy,
    *,
    mini_batch_samples: Optional[int] = None,
    epochs: int = 1,
    shuffle: bool = False,
    seed: Any = None,
    balance: bool = True,
    workload: Workload = "tokens",
    group_ids: Optional[Sequence[Any]] = None,
    prompt_lengths: Optional[Sequence[int]] = None,
    objective: Any = None,
    partitions: Optional[Sequence[Sequence[int]]] = None,
    shared_prompts: Optional[Sequence[Any]] = None,
) -> PhasePlan:
    """Plan every (epoch, mini-batch) of one phase over ``lengths`` (prompt + response tokens per row).

    ``mini_batch_samples``: rows per mini-batch (global; None = the whole phase is one mini-batch);
    ``shuffle``/``seed``: a fresh permutation per epoch (GRPO groups kept adjacent when ``group_ids``);
    ``balance``: balance each mini-batch over the ranks by ``workload`` (else a contiguous split);
    ``prompt_lengths``: needed by the bucketed mode; ``objective``: passed to :func:`plan_step`;
    ``partitions``: a fixed DP partition (an engine used alone: rank r holds exactly these rows), one
    mini-batch, no shuffle; ``shared_prompts``: a prompt id per row (rows sharing one run their prompt
    once; needs ``prompt_lengths``). Deterministic for a given seed.
    """
    if shared_prompts is not None:
        if policy.pipeline is not None:
            raise ValueError("shared prompts do not run through a pipeline engine (its slots pack rows, not prompts)")
        return _plan_shared(lengths, dp_size, policy, shared_prompts, prompt_lengths, mini_batch_samples=mini_batch_samples,
                            epochs=epochs, shuffle=shuffle, seed=seed, balance=balance, workload=workload,
                            group_ids=group_ids, objective=objective, partitions=partitions)
    tokens = _as_lengths(lengths)
    n = len(tokens)
    if isinstance(dp_size, bool) or not isinstance(dp_size, (int, np.integer)) or dp_size < 1:
        raise ValueError(f"dp_size must be a positive integer, got {dp_size!r}")
    buckets = _buckets(policy, prompt_lengths, n)
    if partitions is not None:
        parts = [np.asarray(p, dtype=np.int64).reshape(-1) for p in partitions]
        if len(parts) != dp_size or mini_batch_samples is not None or epochs != 1 or shuffle:
            raise ValueError("a fixed partition plans one mini-batch of one epoch over exactly dp_size ranks")
        validate_partition(parts, n, k=dp_size)
        micro, slot, extra = _micro_batches(tokens, buckets, parts, policy, workload)
        return _assemble([(parts, micro, slot)], policy, 1, metrics=extra)
    size = n if mini_batch_samples is None else int(mini_batch_samples)
    if size < 1 or n % size or size % dp_size:
        raise ValueError(f"{n} rows do not split into mini-batches of {size} rows divisible by dp_size={dp_size}")
    rng = np.random.default_rng(seed) if shuffle else None
    cuts, ratios, extras = [], [], []
    for _ in range(epochs):
        order = _epoch_order(n, rng, group_ids)
        for start in range(0, n, size):
            idx = order[start:start + size]
            groups = None if group_ids is None else np.asarray(group_ids)[idx]
            parts, (micro, slot, extra), ratio = _plan_mini_batch(
                tokens[idx], dp_size, policy, balance, workload, groups, None if buckets is None else buckets[idx],
                objective)
            cuts.append(([idx[p] for p in parts], micro, slot))
            extras.append(extra)
            if ratio is not None:
                ratios.append(ratio)
    metrics = {"plan/num_micro_batches": float(np.mean([len(m[0]) for _, m, _ in cuts]))}
    for key in extras[0]:
        metrics[key] = float(np.mean([extra[key] for extra in extras]))
    if ratios:
        metrics["plan/lockstep_over_lower_bound"] = float(np.mean([r[0] for r in ratios]))
        metrics["plan/lockstep_over_attainable_bound"] = float(np.mean([r[1] for r in ratios]))
        metrics["plan/max_rank_total_over_bound"] = float(np.mean([r[2] for r in ratios]))
    return dataclasses.replace(_assemble(cuts, policy, epochs, metrics), objective=objective if balance else None)


def _buckets(policy: MicroBatchPolicy, prompt_lengths, n: int) -> Optional[np.ndarray]:
    if policy.mode is not MicroBatchMode.BUCKETED:
        return None
    if prompt_lengths is None or len(prompt_lengths) != n:
        raise ValueError(f"the bucketed mode needs the prompt length of each of the {n} rows")
    return bucket_ids(prompt_lengths, policy.bucket_boundaries)


def _epoch_order(n: int, rng: Optional[np.random.Generator], group_ids: Any) -> np.ndarray:
    """Row order of one epoch; with groups, each group's rows are adjacent (first-seen group order
    without shuffling) so that mini-batch cuts do not split groups."""
    if group_ids is None:
        return np.arange(n) if rng is None else rng.permutation(n)
    _, first, inverse = np.unique(np.asarray(group_ids), return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    members = [np.flatnonzero(inverse == g) for g in np.argsort(first, kind="stable")]
    groups = np.arange(len(members)) if rng is None else rng.permutation(len(members))
    return np.concatenate([members[g] for g in groups]) if members else np.zeros(0, dtype=np.int64)


def _plan_mini_batch(tokens, dp_size, policy, balance, workload, groups, buckets, objective):
    """(DP partition as local indices, (micro-batches per rank, pipeline slot, pipeline metrics),
    (lockstep ratios) or None). A pipeline's DP ranks meet once per mini-batch: the partition
    balances their totals and the pipeline planner cuts and orders each rank's share."""
    if balance and policy.mode is MicroBatchMode.DYNAMIC and policy.pipeline is None:
        kwargs = {} if objective is None else {"objective": objective}
        step = plan_step(tokens, dp_size, policy.token_budget, workload, group_ids=groups, **kwargs)
        ratio = (step.lockstep_cost / step.lower_bound if step.lower_bound > 0 else 1.0,
                 step.lockstep_cost / step.attainable_lower_bound if step.attainable_lower_bound > 0 else 1.0,
                 step.max_rank_total / step.rank_total_lower_bound if step.rank_total_lower_bound > 0 else 1.0)
        return step.partitions, ([tuple(rank) for rank in step.local_micro_batches()], None, {}), ratio
    if balance:
        parts = balance_batch(tokens, dp_size, workload=workload, group_ids=groups).partitions
    else:
        parts = list(np.arange(len(tokens), dtype=np.int64).reshape(dp_size, -1))
    return parts, _micro_batches(tokens, buckets, parts, policy, workload), None


def _micro_batches(tokens, buckets, parts, policy: MicroBatchPolicy, workload):
    """(each rank's micro-batches over its partition, the same count on every rank (empties pad a rank
    that holds fewer rows than the count); the pipeline slot or None; pipeline plan metrics)."""
    if policy.pipeline is not None:
        micro, slot, extra = plan_pipeline_micro_batches(
            [tokens[p] for p in parts], policy.pipeline, token_budget=policy.token_budget,
            micro_batch_size=policy.micro_batch_size, workload=workload)
        return [tuple(rank) for rank in micro], slot, extra
    if policy.mode is MicroBatchMode.STATIC:
        size = policy.micro_batch_size
        per_rank = [[np.arange(s, min(s + size, len(p)), dtype=np.int64) for s in range(0, len(p), size)]
                    for p in parts]
    else:
        budget = policy.token_budget
        local = [tokens[p] for p in parts]
        if buckets is None:
            count = max(min_micro_batches(t, budget) if len(t) else 0 for t in local)
            per_rank = [plan_dynamic_micro_batches(t, budget, min(count, len(t)), workload) if len(t) else []
                        for t in local]
        else:
            local_buckets = [buckets[p] for p in parts]
            count = max(min_bucketed_micro_batches(t, b, budget) if len(t) else 0 for t, b in zip(local, local_buckets))
            per_rank = [plan_bucketed_micro_batches(t, b, budget, min(count, len(t)), workload) if len(t) else []
                        for t, b in zip(local, local_buckets)]
    count = max(len(rank) for rank in per_rank)
    empty = np.zeros(0, dtype=np.int64)
    return [tuple(rank) + (empty,) * (count - len(rank)) for rank in per_rank], None, {}


def _assemble(cuts, policy: MicroBatchPolicy, epochs: int, metrics: dict) -> PhasePlan:
    """Rank-major dispatch rows and the per-mini-batch plans from (partition, micro-batches) cuts."""
    dp_size = len(cuts[0][0])
    per_rank: list[list[np.ndarray]] = [[] for _ in range(dp_size)]
    mini = []
    for parts, micro, slot in cuts:
        for r, part in enumerate(parts):
            per_rank[r].append(np.asarray(part, dtype=np.int64))
        mini.append(MiniBatchPlan(tuple(tuple(np.asarray(mb, dtype=np.int64) for mb in rank) for rank in micro),
                                  token_budget=policy.token_budget, slot_tokens=slot))
    empty = np.zeros(0, dtype=np.int64)
    rows = np.concatenate([np.concatenate(parts) if parts else empty for parts in per_rank])
    return PhasePlan(rows=rows, mini_batches=tuple(mini), policy=policy, epochs=epochs, metrics=metrics)


def _plan_shared(lengths, dp_size, policy: MicroBatchPolicy, prompt_ids, prompt_lengths, *, mini_batch_samples,
                 group_ids, partitions, **rest) -> PhasePlan:
    """``plan_phase`` over prompt units (see the module docstring), expanded back to rows."""
    tokens = _as_lengths(lengths)
    n = len(tokens)
    if prompt_lengths is None or len(prompt_lengths) != n or len(prompt_ids) != n:
        raise ValueError(f"shared prompts need a prompt id and a prompt length for each of the {n} rows")
    units = prompt_units(prompt_ids)
    size = units.size
    unit_tokens = shared_lengths(tokens, prompt_lengths, units)
    first_rows = np.array([m[0] for m in units.members], dtype=np.int64)
    if policy.mode is MicroBatchMode.STATIC:
        if policy.micro_batch_size % size:
            raise ValueError(f"micro_batch_size={policy.micro_batch_size} rows is not a whole number of prompts "
                             f"sharing {size} rows each")
        policy_units = dataclasses.replace(policy, micro_batch_size=policy.micro_batch_size // size)
    else:
        policy_units = policy
        too_long = np.flatnonzero(unit_tokens > policy.token_budget)
        if len(too_long):
            u = int(too_long[0])
            raise ValueError(f"the {size} rows sharing prompt {np.asarray(prompt_ids)[first_rows[u]]!r} (rows "
                             f"{units.members[u].tolist()}) run {int(unit_tokens[u])} tokens together, over the "
                             f"micro-batch token budget {policy.token_budget}: a shared prompt's rows must fit one "
                             "micro-batch (raise the budget or turn prompt sharing off)")
    mini_units = None
    if mini_batch_samples is not None:
        if mini_batch_samples % size or (mini_batch_samples // size) % dp_size:
            raise ValueError(f"mini-batches of {mini_batch_samples} rows do not split into whole prompts of {size} "
                             f"rows divisible by dp_size={dp_size}")
        mini_units = mini_batch_samples // size
    elif len(units.members) % dp_size:
        raise ValueError(f"{len(units.members)} prompts of {size} rows each do not split over dp_size={dp_size} "
                         "without splitting a prompt's rows")
    unit_parts = None if partitions is None else _unit_partitions(partitions, units, n)
    plan = plan_phase(unit_tokens, dp_size, policy_units, mini_batch_samples=mini_units,
                      group_ids=None if group_ids is None else np.asarray(group_ids)[first_rows],
                      prompt_lengths=np.asarray(prompt_lengths)[first_rows], partitions=unit_parts, **rest)
    minis = tuple(MiniBatchPlan(tuple(tuple(units.positions(mb) for mb in rank) for rank in mini.micro_batches),
                                token_budget=mini.token_budget, shared_prompts=True) for mini in plan.mini_batches)
    metrics = dict(plan.metrics)
    if tokens.sum() > 0:
        metrics["plan/shared_token_fraction"] = float(unit_tokens.sum() / tokens.sum())
    return dataclasses.replace(plan, rows=units.rows(plan.rows), mini_batches=minis, policy=policy, metrics=metrics)


def _unit_partitions(partitions, units: PromptUnits, n: int) -> list[np.ndarray]:
    """Row partitions as unit partitions; every unit's rows must sit together, in order, in one part."""
    unit_of = np.empty(n, dtype=np.int64)
    for u, rows in enumerate(units.members):
        unit_of[rows] = u
    out = []
    for part in partitions:
        part = np.asarray(part, dtype=np.int64).reshape(-1)
        held = unit_of[part[::units.size]] if len(part) else np.zeros(0, dtype=np.int64)
        if len(part) % units.size or not np.array_equal(units.rows(held), part):
            raise ValueError("a fixed partition must hold whole prompts, each prompt's rows together and in order")
        out.append(held)
    return out
