"""Where a run's old-policy log-probs come from (`OldLogProbSource`), the pass, and the metrics over them.

`old_log_prob_source(cfg, sizes)` decides it once, at start-up (`ballast.trainer.run.run_plan.plan_run`
keeps the value in `RunPlan.old_log_probs`), and it is also the one place `algorithm.rollout_correction`
is parsed: the value owns the parsed settings, and the actor loss, the driver's phases and the
metrics all take them from it. Its mode (`ballast.workers.on_policy.OldLogProbMode`):

* "pass": the actor's inference pass over every row before the update (verl's way; forced by several
  epochs, several local updates per step, a reward KL penalty, decoupled rollout correction or
  `actor.old_log_prob_from_update=False`), written to `old_log_probs`;
* "update", or "partial" with a forward-only pass inside the update over the rows after its first
  mini-batch: the actor update computes them itself and returns them, written to `old_log_probs`;
* "rollout" (bypass rollout correction): the rollout's own log-probs are the old policy. No pass runs
  and nothing is copied: every reader (the loss, the reward KL) reads `rollout_log_probs`, so the
  column `old_log_probs` only ever holds the actor's log-probs, and a bypass step has none.

`OldLogProbSource.column` names the column holding the old policy's values; `actor_column` the one the
rollout-vs-actor metrics compare the rollout's with (bypass: the log-probs each row was trained with).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import torch

from ballast.balance import PhasePlan
from ballast.protocol import Batch
from ballast.trainer.algorithms.policy_loss import ActorLossConfig, entropy_metric
from ballast.trainer.algorithms.rollout_correction import RolloutCorrection
from ballast.trainer.config.off_policy import overlap
from ballast.trainer.step.rollout_correction import loss_correction, rollout_correction_settings
from ballast.workers.on_policy import OLD_LOG_PROBS_KEY, OldLogProbMode, old_log_prob_mode

ROLLOUT_LOG_PROBS_KEY = "rollout_log_probs"
TRAIN_LOG_PROBS_KEY = "train_log_probs"


@dataclass(frozen=True)
class OldLogProbSource:
    """A run's old-log-prob source: the mode and the rollout-correction settings it was decided from."""

    mode: OldLogProbMode
    correction: RolloutCorrection

    def __post_init__(self) -> None:
        # Built by `old_log_prob_source`; a mismatch here is a programming error, not a user's.
        if (self.mode is OldLogProbMode.ROLLOUT) != self.correction.bypass_mode:
            raise ValueError(f"old-log-prob mode {self.mode.value!r} with bypass_mode={self.correction.bypass_mode}")
        if self.correction.needs_old_log_probs_before_update and self.mode is not OldLogProbMode.PASS:
            raise ValueError(f"decoupled rollout correction needs mode 'pass', not {self.mode.value!r}")

    @property
    def bypass(self) -> bool:
        """Bypass rollout correction: the rollout's log-probs are the old policy."""
        return self.mode is OldLogProbMode.ROLLOUT

    @property
    def column(self) -> str:
        """The Batch column that holds the old policy's log-probs."""
        return ROLLOUT_LOG_PROBS_KEY if self.bypass else OLD_LOG_PROBS_KEY

    @property
    def actor_column(self) -> str:
        """The column with the actor's log-probs that the rollout's are compared with."""
        return TRAIN_LOG_PROBS_KEY if self.bypass else OLD_LOG_PROBS_KEY

    @property
    def loss_correction(self) -> Optional[RolloutCorrection]:
        """What the actor loss applies: None unless the loss itself corrects (`loss_correction`)."""
        return loss_correction(self.correction)

    def runs_pass(self, updates_actor: bool) -> bool:
        """Whether a step runs the separate pass: mode "pass", or a step without an actor update (the
        update cannot supply them) unless the rollout's log-probs serve."""
        return self.mode is OldLogProbMode.PASS or (not updates_actor and not self.bypass)

    def update_mode(self, separate_pass: bool) -> OldLogProbMode:
        """The mode the actor update runs in: "pass" once a separate pass has supplied them."""
        return OldLogProbMode.PASS if separate_pass else self.mode


def old_log_prob_source(cfg, sizes) -> OldLogProbSource:
    """The run's source: `algorithm.rollout_correction` parsed (ConfigError naming the key) and the mode.
    Several local updates per step train the later ones on weights the first has changed, while their
    old log-probs are the step's starting policy (verl's), so one pass before them provides all."""
    corr = rollout_correction_settings(cfg)
    actor = cfg.actor_rollout_ref.actor
    mode = old_log_prob_mode(
        sizes.actor.num_mini_batches, actor.ppo_epochs, cfg.algorithm.use_kl_in_reward,
        enabled=actor.old_log_prob_from_update and overlap(cfg).local_updates == 1,
        needed_before_update=corr.needs_old_log_probs_before_update, rollout_is_old=corr.bypass_mode)
    return OldLogProbSource(mode, corr)


def from_dispatch_order(parts: Sequence[torch.Tensor], plan: PhasePlan) -> torch.Tensor:
    """Per-rank outputs of a one-epoch phase (each rank's rows in dispatch order) in step-row order."""
    return torch.cat(list(parts))[torch.as_tensor(plan.restore_index())]


def old_log_prob_metrics(batch: Batch, loss_cfg: ActorLossConfig, actor_key: str = OLD_LOG_PROBS_KEY) -> Dict[str, float]:
    """`actor/entropy` (over the step, aggregated as the actor loss, see `entropy_metric`; when a pass
    measured it) and, when the rollout reported its own log-probs, the rollout-vs-actor difference
    (`actor_key`: the actor's log-probs): a direct check that weight sync keeps the two models identical."""
    mask = batch["response_mask"]
    metrics = {}
    if "entropy" in batch:
        metrics["actor/entropy"] = entropy_metric(batch["entropy"], mask, loss_cfg.loss_agg_mode,
                                                  loss_cfg.loss_scale_factor)
    if ROLLOUT_LOG_PROBS_KEY in batch and actor_key in batch:
        diff = (batch[ROLLOUT_LOG_PROBS_KEY] - batch[actor_key]).abs()[mask.bool()]
        metrics["training/rollout_actor_log_prob_diff/mean"] = float(diff.mean()) if diff.numel() else 0.0
        metrics["training/rollout_actor_log_prob_diff/max"] = float(diff.max()) if diff.numel() else 0.0
    return metrics


def run_pass(actor_group, batch: Batch, plan: PhasePlan) -> Dict[str, float]:
    """The separate pass over every row: sets `old_log_probs` and `entropy` in `batch`; returns the
    pass's own metrics (MFU)."""
    out = actor_group.compute_log_prob(batch[plan.rows], plan)
    index = torch.as_tensor(plan.restore_index())
    batch["old_log_probs"] = out.batch["old_log_probs"][index]
    batch["entropy"] = out.batch["entropy"][index]
    return out.mean_metrics()


def take_from_update(batch: Batch, results: Sequence, plan: PhasePlan) -> None:
    """Set `old_log_probs` and `entropy` in `batch` from what each DP rank's update returned."""
    missing = [r for r, result in enumerate(results) if result.old_log_probs is None]
    if missing:
        raise RuntimeError(f"the actor update of DP ranks {missing} returned no old log-probs")
    batch["old_log_probs"] = from_dispatch_order([r.old_log_probs for r in results], plan)
    batch["entropy"] = from_dispatch_order([r.entropy for r in results], plan)
