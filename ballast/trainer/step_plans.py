"""The driver's central plan of an update phase: every epoch's mini-batches, each planned for all DP
ranks at once by `ballast.balance.plan_step` (which samples each rank runs, and its micro-batches).

The plan travels with the data: the step batch is laid out so that DP rank r's contiguous chunk is
its rows for mini-batch 0 of epoch 0, then mini-batch 1, ... (a sample appears once per epoch), and
`meta[MINI_BATCH_PLANS_KEY]` lists, per mini-batch, `plan[r][j]` = the rows (inside rank r's slice
of that mini-batch) of its j-th micro-batch. Every rank gets the same list, so the micro-batch counts
agree without communication; the worker's train loop walks it (`run_train_loop(..., plans=...)`).

Mini-batches are cut from a fresh permutation of the step's samples per epoch when shuffling (seeded
by the trainer seed and the step, so a resumed run plans the same), keeping a GRPO group's samples
adjacent when groups are kept together.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

from ballast.balance import Workload, plan_step


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
    """``rows``: step-batch row of every dispatched row (length N * epochs, rank-major); ``plans``:
    one central micro-batch plan per mini-batch, in execution order; ``metrics``: plan quality."""

    rows: np.ndarray
    plans: list
    metrics: dict


def _epoch_order(n: int, rng: Optional[np.random.Generator], group_ids: Any) -> np.ndarray:
    """Sample order of one epoch; with groups, each group's samples are adjacent (in first-seen group
    order without shuffling) so that mini-batch cuts do not split groups."""
    if group_ids is None:
        return np.arange(n) if rng is None else rng.permutation(n)
    _, first, inverse = np.unique(np.asarray(group_ids), return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    members = [np.flatnonzero(inverse == g) for g in np.argsort(first, kind="stable")]
    groups = np.arange(len(members)) if rng is None else rng.permutation(len(members))
    return np.concatenate([members[g] for g in groups])


def plan_update(
    lengths: np.ndarray,
    dp: int,
    mini_batch_samples: int,
    max_tokens: int,
    epochs: int,
    shuffle: bool,
    seed: Any,
    workload: Workload = "tokens",
    group_ids: Any = None,
) -> UpdatePlan:
    """Plan every (epoch, mini-batch) of one update phase; see the module docstring."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    if n % mini_batch_samples:
        raise ValueError(f"the step holds {n} samples, not a multiple of the mini-batch size {mini_batch_samples}")
    rng = np.random.default_rng(seed) if shuffle else None
    per_rank: list[list[np.ndarray]] = [[] for _ in range(dp)]
    plans, ratios, attainable = [], [], []
    for _ in range(epochs):
        order = _epoch_order(n, rng, group_ids)
        for start in range(0, n, mini_batch_samples):
            idx = order[start:start + mini_batch_samples]
            groups = None if group_ids is None else np.asarray(group_ids)[idx]
            step = plan_step(lengths[idx], dp, max_tokens, workload, group_ids=groups)
            for r, part in enumerate(step.partitions):
                per_rank[r].append(idx[part])
            plans.append(step.local_micro_batches())
            ratios.append(step.lockstep_cost / step.lower_bound if step.lower_bound > 0 else 1.0)
            bound = step.attainable_lower_bound
            attainable.append(step.lockstep_cost / bound if bound > 0 else 1.0)
    rows = np.concatenate([np.concatenate(parts) for parts in per_rank])
    metrics = {"plan/lockstep_over_lower_bound": float(np.mean(ratios)),
               "plan/lockstep_over_attainable_bound": float(np.mean(attainable)),
               "plan/num_micro_batches": float(np.mean([len(p[0]) for p in plans]))}
    return UpdatePlan(rows=rows, plans=plans, metrics=metrics)


class UpdatePlanner:
    """Which update phases the driver plans centrally, and their plans for one step.

    A role is planned centrally when balancing is on, its micro-batches are dynamic and not
    length-bucketed; otherwise its ranks plan alone (and `plan` returns None).
    """

    def __init__(self, cfg, sizes, workload: Workload) -> None:
        self.cfg, self.sizes, self.workload = cfg, sizes, workload

    def _role(self, role: str):
        role_cfg = self.cfg.actor_rollout_ref.actor if role == "actor" else self.cfg.critic
        return getattr(self.sizes, role), role_cfg

    def plans_centrally(self, role: str) -> bool:
        sizes, role_cfg = self._role(role)
        if sizes is None or sizes.train is None:
            return False
        bucketed = bool(getattr(role_cfg, "dynamic_bsz_bucketing", False))
        return bool(self.cfg.trainer.balance_batch and sizes.train.use_dynamic_bsz and not bucketed)

    def plan(self, lengths: np.ndarray, role: str, global_step: int, group_ids: Any = None) -> Optional[UpdatePlan]:
        """The central plan of `role`'s update for the step after `global_step`, or None."""
        if not self.plans_centrally(role):
            return None
        sizes, role_cfg = self._role(role)
        return plan_update(lengths, sizes.dp_size, sizes.mini_batch_samples, sizes.token_budget(sizes.train),
                           role_cfg.ppo_epochs, role_cfg.shuffle,
                           seed=[self.cfg.trainer.seed, global_step, int(role == "critic")],
                           workload=self.workload, group_ids=group_ids)
