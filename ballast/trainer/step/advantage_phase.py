"""From a step's scores to its advantages, in verl's order (the driver's `adv` phase).

    token_level_rewards = token_level_scores [- beta * KL(old || ref) over the response mask]
    -> rollout correction (decoupled mode: importance weights, rejection written into response_mask)
    -> advantage estimator over the corrected mask: advantages, returns

The KL penalty sees the response mask as generated: a token or row that the correction rejects
still pays its penalty, the in-reward KL it adds to the controller is counted, and its score stays
in its group's statistics, as in verl's fit loop (`apply_kl_penalty`, then
`compute_rollout_correction_and_add_to_batch`, then `compute_advantage`). Rejection then takes the
rejected tokens out of the advantages and of everything the update reads.
"""

from __future__ import annotations

from typing import Callable, ContextManager, Dict, Tuple

import torch

from ballast.protocol import Batch
from ballast.trainer.algorithms import get_adv_estimator, kl_penalty, masked_mean
from ballast.trainer.step.rollout_correction import RolloutCorrectionPhase

# `timer(name)`: a context manager adding the time of its block to the step's `timing_s/<name>`
Timer = Callable[[str], ContextManager]


def rewards_and_advantages(batch: Batch, alg, kl_ctrl, correction: RolloutCorrectionPhase,
                           timer: Timer, old_log_probs: str = "old_log_probs") -> Dict[str, float]:
    """Write `token_level_rewards`, the correction's columns (and its `response_mask`), `advantages`
    and `returns` into `batch`, in the module docstring's order; returns the KL and correction metrics.
    `alg` is the config's `algorithm` section; `kl_ctrl` is updated with this step's KL; `old_log_probs`
    names the column of the old policy's log-probs (`OldLogProbSource.column`: the rollout's in bypass
    mode), what the in-reward KL measures against the reference."""
    metrics: Dict[str, float] = {}
    with timer("adv"):
        rewards = batch["token_level_scores"]
        if alg.use_kl_in_reward:
            mask = batch["response_mask"].float()
            kld = kl_penalty(batch[old_log_probs], batch["ref_log_prob"], alg.kl_penalty) * mask
            rewards, metrics = apply_kl_in_reward(rewards, kld, mask, kl_ctrl)
        batch["token_level_rewards"] = rewards
    with timer("rollout_corr"):
        metrics.update(correction.before_advantages(batch))
    with timer("adv"):
        adv, returns = get_adv_estimator(alg.adv_estimator)(
            token_level_rewards=rewards, response_mask=batch["response_mask"].float(), index=batch["uid"],
            values=batch["values"] if "values" in batch else None, gamma=alg.gamma, lam=alg.lam,
            norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo,
        )
        batch["advantages"], batch["returns"] = adv, returns
    return metrics


def apply_kl_in_reward(scores: torch.Tensor, kld: torch.Tensor, mask: torch.Tensor,
                       kl_ctrl) -> Tuple[torch.Tensor, Dict[str, float]]:
    """rewards = scores - beta * kl with the coefficient beta of this step, then the controller update.

    The logged coefficient is the one applied to this step's rewards (as verl logs it), not the
    updated one that the next step will use.
    """
    beta = kl_ctrl.value
    rewards = scores - beta * kld
    current_kl = float(masked_mean(kld, mask, dim=-1).mean())  # per-sequence mean, then batch mean
    kl_ctrl.update(current_kl, n_steps=int(scores.shape[0]))
    return rewards, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
