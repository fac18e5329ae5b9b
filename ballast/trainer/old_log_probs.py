"""Driver side of the old log-probs (`OldLogProbPass`): which rows the separate pass covers, its
layout, filling in the rows the actor update computed (see `ballast.workers.on_policy`), and the
pass's metrics over every row.

Rows are positions in the step batch (after balancing). The update batch is `batch[update_rows]`,
cut into equal contiguous chunks, one per DP rank; inside a chunk the first
`mini_batch_samples_per_rank` rows are that rank's first mini-batch.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np
import torch

from ballast.balance import balance_batch, plan_step
from ballast.protocol import Batch
from ballast.trainer.algorithms.policy_loss import ActorLossConfig, entropy_metric
from ballast.workers.train_loop import LOG_PROB_PLAN_KEY


def pass_layout(lengths: np.ndarray, dp: int, token_budget: Optional[int], workload, group_ids=None):
    """(sample order, DP partitions, central micro-batch plan or None) of an inference pass: with a
    token budget, ranks and micro-batches planned together (`plan_step`); without one (static or
    length-bucketed micro-batches, which the ranks cut themselves), a balanced DP split only."""
    if token_budget is not None:
        step_plan = plan_step(lengths, dp, token_budget, workload=workload, group_ids=group_ids)
        return step_plan.order, step_plan.partitions, step_plan.local_micro_batches()
    plan = balance_batch(lengths, dp, workload=workload, group_ids=group_ids)
    return plan.order, plan.partitions, None


def first_mini_batch_rows(update_rows: np.ndarray, dp: int, mini_batch_samples_per_rank: int) -> np.ndarray:
    """Step-batch rows that every DP rank trains in its first mini-batch (epoch 0), sorted."""
    if len(update_rows) % dp:
        raise AssertionError(f"{len(update_rows)} update rows do not split into {dp} equal chunks")
    per_rank = len(update_rows) // dp
    chunks = np.asarray(update_rows).reshape(dp, per_rank)
    return np.sort(chunks[:, :mini_batch_samples_per_rank].reshape(-1))


def fill_from_update(batch: Batch, entropy: torch.Tensor, results: Sequence, update_rows: np.ndarray) -> int:
    """Write the log-probs and entropies that each DP rank's update returned into `batch` and
    `entropy` (in place); returns how many rows were filled."""
    per_rank = len(update_rows) // len(results)
    filled = 0
    for rank, result in enumerate(results):
        got = result.update_log_probs
        if got is None:
            continue
        rows = np.asarray(update_rows)[rank * per_rank + np.asarray(got.rows, dtype=np.int64)]
        index = torch.as_tensor(rows, dtype=torch.long)
        batch["old_log_probs"][index] = got.old_log_probs.to(batch["old_log_probs"].dtype)
        entropy[index] = got.entropy.to(entropy.dtype)
        filled += len(rows)
    return filled


def old_log_prob_metrics(batch: Batch, entropy: torch.Tensor, loss_cfg: ActorLossConfig) -> Dict[str, float]:
    """`actor/entropy` (over the step, aggregated as the actor loss, see `entropy_metric`) and, when the
    rollout reported its own log-probs, the rollout-vs-actor difference: a direct check that weight sync
    keeps the two models identical."""
    metrics = {"actor/entropy": entropy_metric(entropy, batch["response_mask"], loss_cfg.loss_agg_mode,
                                               loss_cfg.loss_scale_factor)}
    if "rollout_log_probs" in batch:
        mask = batch["response_mask"].bool()
        diff = (batch["rollout_log_probs"] - batch["old_log_probs"]).abs()[mask]
        metrics["training/rollout_actor_log_prob_diff/mean"] = float(diff.mean()) if diff.numel() else 0.0
        metrics["training/rollout_actor_log_prob_diff/max"] = float(diff.max()) if diff.numel() else 0.0
    return metrics


class OldLogProbPass:
    """The driver's old-log-prob phase: which rows the actor update supplies itself (`mode`, see
    `ballast.workers.on_policy.first_mini_batch_mode`) and the pass over the others."""

    def __init__(self, cfg, sizes, workload, mode: str) -> None:
        self.cfg, self.sizes, self.workload, self.mode = cfg, sizes, workload, mode

    def budget(self) -> Optional[int]:
        """The pass's token budget per micro-batch when the driver plans it, else None."""
        infer = self.sizes.actor.infer
        if infer.use_dynamic_bsz and not self.cfg.actor_rollout_ref.actor.dynamic_bsz_bucketing:
            return self.sizes.actor.token_budget(infer)
        return None

    def rows_from_update(self, actor_plan, num_rows: int) -> Optional[np.ndarray]:
        """Rows (bool mask) whose old log-probs the actor update computes itself, or None."""
        if self.mode == "update":
            return np.ones(num_rows, dtype=bool)
        if self.mode == "partial" and actor_plan is not None:
            mask = np.zeros(num_rows, dtype=bool)
            mask[first_mini_batch_rows(actor_plan.rows, self.sizes.actor.dp_size,
                                       self.sizes.actor.mini_batch_samples_per_rank)] = True
            return mask
        return None

    def run(self, actor_group, batch: Batch, entropy: torch.Tensor,
            from_update: Optional[np.ndarray] = None) -> Dict[str, float]:
        """The pass over every row not in `from_update` (those come with the update; `batch` then holds
        placeholder old log-probs and no whole-step plan): fills `batch["old_log_probs"]` and `entropy`
        for them; returns the pass's own metrics (MFU)."""
        if from_update is None:
            sub, rows = batch, np.arange(len(batch))
        else:  # a balanced layout and plan of its own for the rows the pass covers
            rows = np.flatnonzero(~from_update)
            sub = batch[rows]
            rows = rows[self._layout(sub)]
        out = actor_group.compute_log_prob(sub)
        batch.meta.pop(LOG_PROB_PLAN_KEY, None)  # consumed: later phases plan their own
        if from_update is None:
            batch["old_log_probs"] = out["old_log_probs"]
        else:  # the update's rows hold placeholders until it returns their values
            batch["old_log_probs"][torch.as_tensor(rows)] = out["old_log_probs"]
        entropy[torch.as_tensor(rows)] = out["entropy"].to(entropy.dtype)
        return {k: float(np.mean(v)) for k, v in out.meta.get("metrics", {}).items() if v}

    def _layout(self, sub: Batch) -> np.ndarray:
        """Balance `sub` over the DP ranks for a pass of its own (in place, with its central
        micro-batch plan when dynamic); returns the order applied."""
        groups = sub["uid"] if self.cfg.trainer.balance_keep_groups else None
        order, _, micro_plan = pass_layout(sub["attention_mask"].sum(-1).numpy(), self.sizes.actor.dp_size,
                                           self.budget(), self.workload, groups)
        if micro_plan is not None:
            sub.meta[LOG_PROB_PLAN_KEY] = micro_plan
        sub.reorder(order)
        return np.asarray(order)
