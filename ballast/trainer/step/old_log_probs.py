"""The driver's old-log-prob phase: where a step's old log-probs come from, and the metrics over them.

`OldLogProbPhase.mode` (`ballast.workers.on_policy.OldLogProbMode`) is decided once per run: "pass"
runs the actor's inference pass over every row before the update (verl's way; forced by several
epochs, several local updates per step, a reward KL penalty, decoupled rollout correction or
`actor.old_log_prob_from_update=False`);
"rollout" (bypass rollout correction) runs none, the rollout's log-probs being the old policy;
otherwise the actor update computes them itself ("update", or "partial" with a forward-only pass
inside the update over the rows after its first mini-batch) and returns them. Either way
`batch["old_log_probs"]` holds every row's values at the end of the step, and the metrics of the pass
cover every row.
"""

from __future__ import annotations

from typing import Dict, Sequence

import torch

from ballast.balance import PhasePlan
from ballast.protocol import Batch
from ballast.trainer.algorithms.policy_loss import ActorLossConfig, entropy_metric
from ballast.trainer.config.off_policy import overlap
from ballast.workers.on_policy import OldLogProbMode, old_log_prob_mode


def from_dispatch_order(parts: Sequence[torch.Tensor], plan: PhasePlan) -> torch.Tensor:
    """Per-rank outputs of a one-epoch phase (each rank's rows in dispatch order) in step-row order."""
    return torch.cat(list(parts))[torch.as_tensor(plan.restore_index())]


def old_log_prob_metrics(batch: Batch, loss_cfg: ActorLossConfig, actor_key: str = "old_log_probs") -> Dict[str, float]:
    """`actor/entropy` (over the step, aggregated as the actor loss, see `entropy_metric`; when a pass
    measured it) and, when the rollout reported its own log-probs, the rollout-vs-actor difference
    (`actor_key`: the actor's log-probs): a direct check that weight sync keeps the two models identical."""
    mask = batch["response_mask"]
    metrics = {}
    if "entropy" in batch:
        metrics["actor/entropy"] = entropy_metric(batch["entropy"], mask, loss_cfg.loss_agg_mode,
                                                  loss_cfg.loss_scale_factor)
    if "rollout_log_probs" in batch and actor_key in batch:
        diff = (batch["rollout_log_probs"] - batch[actor_key]).abs()[mask.bool()]
        metrics["training/rollout_actor_log_prob_diff/mean"] = float(diff.mean()) if diff.numel() else 0.0
        metrics["training/rollout_actor_log_prob_diff/max"] = float(diff.max()) if diff.numel() else 0.0
    return metrics


class OldLogProbPhase:
    """Which of the three modes a run uses, the separate pass, and taking the update's values."""

    def __init__(self, cfg, sizes, correction=None) -> None:
        actor = cfg.actor_rollout_ref.actor
        # Several local updates per step: the later ones train on weights the first has changed, while
        # their old log-probs are the step's starting policy (verl's), so one pass before them provides all.
        self.mode = old_log_prob_mode(
            sizes.actor.num_mini_batches, actor.ppo_epochs, cfg.algorithm.use_kl_in_reward,
            enabled=actor.old_log_prob_from_update and overlap(cfg).local_updates == 1,
            needed_before_update=correction is not None and correction.needs_old_log_probs_before_update,
            rollout_is_old=correction is not None and correction.bypass_mode)

    def runs_pass(self, updates_actor: bool) -> bool:
        """Whether this step runs the separate pass: mode "pass", or a step without an actor update
        (the update cannot supply them) unless the rollout's log-probs serve."""
        return self.mode is OldLogProbMode.PASS or (not updates_actor and self.mode is not OldLogProbMode.ROLLOUT)

    def run_pass(self, actor_group, batch: Batch, plan: PhasePlan) -> Dict[str, float]:
        """The separate pass over every row (mode "pass"): sets `old_log_probs` and `entropy` in
        `batch`; returns the pass's own metrics (MFU)."""
        out = actor_group.compute_log_prob(batch[plan.rows], plan)
        index = torch.as_tensor(plan.restore_index())
        batch["old_log_probs"] = out.batch["old_log_probs"][index]
        batch["entropy"] = out.batch["entropy"][index]
        return out.mean_metrics()

    @staticmethod
    def take_from_update(batch: Batch, results: Sequence, plan: PhasePlan) -> None:
        """Set `old_log_probs` and `entropy` in `batch` from what each DP rank's update returned."""
        missing = [r for r, result in enumerate(results) if result.old_log_probs is None]
        if missing:
            raise RuntimeError(f"the actor update of DP ranks {missing} returned no old log-probs")
        batch["old_log_probs"] = from_dispatch_order([r.old_log_probs for r in results], plan)
        batch["entropy"] = from_dispatch_order([r.entropy for r in results], plan)
