"""The driver's plans of one step's phases: every phase that reaches a worker gets one `PhasePlan`.

`StepPlanner` is the one place that turns the config into `ballast.balance.plan_phase` calls:

* inference phases (old log-probs, reference log-probs, values): the whole step as one mini-batch of
  one epoch, each with its role's DP size and inference micro-batch policy; identical requests within
  a step share one plan;
* update phases (critic, actor): every epoch's mini-batches (a fresh permutation per epoch when
  `shuffle`, seeded by the trainer seed, the step and the role, so a resumed run plans the same),
  with the role's training micro-batch policy;
* the forward-only pass that an actor update runs over the rows after its first mini-batch, when it
  supplies the old log-probs itself (see `ballast.workers.on_policy`): planned over the rows each rank
  already holds.

`trainer.balance_batch` balances every phase over the DP ranks (otherwise a contiguous split), by
`trainer.balance_workload`, keeping a prompt's samples on one rank with `trainer.balance_keep_groups`,
for the objective of the engine that runs the phase (`phase_objectives`): where its ranks meet in a
collective every micro-batch (FSDP2 re-gathering parameters) a step waits on the lockstep cost; where
they meet once per mini-batch (DDP, frozen replicas) on the slowest rank's total. With
`actor_rollout_ref.actor.use_prefix_grouper` the actor's and the reference's phases are planned over
prompts (a prompt's rows never split; each prompt runs once, `ballast.balance.shared_prompts`). A role
with pipeline parallelism (`<role>.megatron.pipeline_model_parallel_size` > 1) is planned with its
pipeline cost model (`RoleSizes.policy`): fixed slots, counts the schedule runs, the planned order.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np

from ballast.balance import MicroBatchMode, MiniBatchPlan, PhasePlan, PlanObjective, Workload, plan_phase
from ballast.engine.data_parallel import micro_batch_lockstep
from ballast.engine.parallelize import data_parallel_mode
from ballast.protocol import Batch

ROLES = ("actor", "critic", "ref")


def row_lengths(batch: Batch) -> np.ndarray:
    """Real tokens (prompt + response) of every row."""
    return batch["attention_mask"].sum(-1).numpy()


def prompt_lengths(batch: Batch) -> np.ndarray:
    """Real prompt tokens of every row (the bucketed mode groups by them)."""
    width = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    return batch["attention_mask"][:, :width].sum(-1).numpy()


def prompt_ids(batch: Batch) -> np.ndarray:
    """An id per row, equal for the samples of one prompt (`uid`) whose prompts are equal (tokens and
    positions: what the engine groups by), so that the planner's units are the GRPO groups even where
    the data holds a prompt twice (`actor_rollout_ref.actor.use_prefix_grouper`)."""
    width = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    mask = batch["attention_mask"][:, :width].numpy().astype(bool)
    uid = np.unique(np.asarray(batch["uid"]), return_inverse=True)[1].reshape(-1, 1)
    key = np.concatenate([uid, np.where(mask, batch["input_ids"][:, :width].numpy(), -1),
                          np.where(mask, batch["position_ids"][:, :width].numpy(), -1)], axis=1)
    return np.unique(key, axis=0, return_inverse=True)[1].reshape(-1)


def phase_objectives(engines: Dict[str, Any], world_size: int, device_type: str) -> Dict[tuple, PlanObjective]:
    """`{(role, backward): objective}` for every role's engine config in `engines` on `world_size`
    ranks of `device_type`: inference phases run forward only, updates forward and backward."""
    out = {}
    for role, cfg in engines.items():
        mode = data_parallel_mode(cfg, world_size, device_type)
        for backward in (False, True):
            lockstep = micro_batch_lockstep(mode, device_type, cfg.reshard_after_forward, backward)
            out[(role, backward)] = PlanObjective.LOCKSTEP if lockstep else PlanObjective.RANK_TOTAL
    return out


class StepPlanner:
    """Plans of one step's phases over the step's `batch` (rows in generation order), for `sizes` (the
    derived per-role sizes) under `cfg`; made anew every step."""

    def __init__(self, cfg, sizes, workload: Workload, batch: Batch, global_step: int,
                 objectives: Optional[Dict[tuple, PlanObjective]] = None) -> None:
        self.cfg, self.sizes, self.workload = cfg, sizes, workload
        self.batch, self.global_step = batch, global_step
        self.objectives = objectives or {}
        self._inference: Dict[tuple, PhasePlan] = {}

    def _role(self, role: str):
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}")
        return getattr(self.sizes, role)

    def _shares_prompts(self, role: str) -> bool:
        return role != "critic" and self.cfg.actor_rollout_ref.actor.use_prefix_grouper

    def _common(self, batch: Batch, role: str, policy, backward: bool) -> dict:
        keep_groups, share = self.cfg.trainer.balance_keep_groups, self._shares_prompts(role)
        bucketed = policy.mode is MicroBatchMode.BUCKETED
        return dict(balance=self.cfg.trainer.balance_batch, workload=self.workload,
                    group_ids=batch["uid"] if keep_groups else None,
                    prompt_lengths=prompt_lengths(batch) if bucketed or share else None,
                    shared_prompts=prompt_ids(batch) if share else None,
                    objective=self.objectives.get((role, backward)))

    def inference(self, role: str) -> PhasePlan:
        """The plan of `role`'s inference pass over every row (identical requests share one plan)."""
        sizes = self._role(role)
        policy = sizes.policy(sizes.infer)
        key = (sizes.dp_size, policy, self.objectives.get((role, False)), self._shares_prompts(role))
        if key not in self._inference:
            self._inference[key] = plan_phase(row_lengths(self.batch), sizes.dp_size, policy,
                                              **self._common(self.batch, role, policy, backward=False))
        return self._inference[key]

    def update(self, role: str) -> PhasePlan:
        """The plan of `role`'s update (every epoch and mini-batch)."""
        sizes = self._role(role)
        role_cfg = self.cfg.actor_rollout_ref.actor if role == "actor" else self.cfg.critic
        policy = sizes.policy(sizes.train)
        return plan_phase(row_lengths(self.batch), sizes.dp_size, policy, mini_batch_samples=sizes.mini_batch_samples,
                          epochs=role_cfg.ppo_epochs, shuffle=role_cfg.shuffle,
                          seed=[self.cfg.trainer.seed, self.global_step, ROLES.index(role)],
                          **self._common(self.batch, role, policy, backward=True))

    def after_first_mini_batch(self, actor_plan: PhasePlan) -> Optional[MiniBatchPlan]:
        """The actor's forward-only plan over each rank's rows after its first mini-batch, or None
        when the update has a single mini-batch (see `plan_after_first_mini_batch`)."""
        sizes = self.sizes.actor
        policy = sizes.policy(sizes.infer)
        share = self._shares_prompts("actor")
        prompts = prompt_lengths(self.batch) if policy.mode is MicroBatchMode.BUCKETED or share else None
        return plan_after_first_mini_batch(row_lengths(self.batch), actor_plan, policy, self.workload, prompts,
                                           prompt_ids(self.batch) if share else None)


def plan_after_first_mini_batch(lengths: np.ndarray, plan: PhasePlan, policy, workload: Workload = "tokens",
                                prompt_lengths: Optional[np.ndarray] = None,
                                shared_prompts: Optional[np.ndarray] = None) -> Optional[MiniBatchPlan]:
    """The inference plan of every rank's rows after its first mini-batch of the one-epoch update
    `plan`, over the rows where they already are (rank r's rows, in its dispatch order), or None when
    the update has a single mini-batch. `lengths`/`prompt_lengths`/`shared_prompts` (prompt ids, to
    run each prompt once) are per step row."""
    if len(plan.mini_batches) == 1:
        return None
    if plan.epochs != 1:
        raise ValueError(f"old log-probs from the update need one epoch, the plan has {plan.epochs}")
    rows, parts, start = [], [], 0
    for r in range(plan.dp_size):
        rest = plan.rank_rows(r)[plan.mini_batches[0].rows_per_rank[r]:]
        rows.append(rest)
        parts.append(np.arange(start, start + len(rest)))
        start += len(rest)
    rows = np.concatenate(rows)
    prompts = None if prompt_lengths is None else np.asarray(prompt_lengths)[rows]
    shared = None if shared_prompts is None else np.asarray(shared_prompts)[rows]
    return plan_phase(np.asarray(lengths)[rows], plan.dp_size, policy, workload=workload, partitions=parts,
                      prompt_lengths=prompts, shared_prompts=shared).mini_batches[0]


def plan_metrics(plan: PhasePlan, role: str) -> Dict[str, float]:
    """The plan's quality figures under `balance/{role}_*`."""
    return {f"balance/{role}_{key}": value for key, value in plan.metrics.items()}


def epoch_partitions(plan: PhasePlan) -> list[np.ndarray]:
    """Step rows each rank holds over the plan's first epoch (the step's DP split as run)."""
    per_epoch = len(plan.mini_batches) // plan.epochs
    parts = [plan.partitions(m) for m in range(per_epoch)]
    return [np.concatenate([p[r] for p in parts]) for r in range(plan.dp_size)]
