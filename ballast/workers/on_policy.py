"""The on-policy shortcut: with one mini-batch and one epoch per step, the "old" policy that generated
the samples is exactly the policy the update differentiates, so its log-probs need no forward pass
of their own. The update's own forward supplies them, detached (the PPO ratio is then exactly 1 and
its gradient is the plain policy gradient), and the metrics that the separate pass used to produce
(entropy, rollout-vs-actor log-prob difference) come from that same forward.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch
import torch.distributed as dist

OLD_LOG_PROBS_KEY = "old_log_probs"
ROLLOUT_LOG_PROBS_KEY = "rollout_log_probs"


def is_on_policy(num_mini_batches: int, ppo_epochs: int, use_kl_in_reward: bool) -> bool:
    """Whether the driver may skip the old-log-prob pass.

    A reward KL penalty needs the old log-probs before the update (to build the rewards), so it rules
    the shortcut out.
    """
    return num_mini_batches == 1 and ppo_epochs == 1 and not use_kl_in_reward


class OnPolicyLoss:
    """Wraps an actor loss: old log-probs := the micro-batch's own log-probs, detached.

    Adds `actor/entropy` (token mean over the mini-batch, as a share like every engine metric) and
    the `training/rollout_actor_log_prob_diff/mean` share when the rollout's log-probs are present;
    the max of that difference is kept on the side (`diff_max`), since the engine sums metrics.
    """

    def __init__(self, loss_fn) -> None:
        self.loss_fn = loss_fn
        self._diff_max: Optional[torch.Tensor] = None

    def __call__(self, outputs: Dict[str, torch.Tensor], micro, norm):
        log_probs = outputs["log_probs"].detach()
        micro = micro.copy()
        micro.set(OLD_LOG_PROBS_KEY, log_probs)
        loss, metrics = self.loss_fn(outputs, micro, norm)
        mask = micro["response_mask"].to(log_probs.dtype)
        tokens = max(norm.num_tokens, 1)
        if "entropy" in outputs:
            metrics["actor/entropy"] = (outputs["entropy"].detach() * mask).sum() / tokens
        if ROLLOUT_LOG_PROBS_KEY in micro.keys():
            diff = (micro[ROLLOUT_LOG_PROBS_KEY].to(log_probs.dtype) - log_probs).abs() * mask
            metrics["training/rollout_actor_log_prob_diff/mean"] = diff.sum() / tokens
            local_max = diff.max() if diff.numel() else torch.zeros((), dtype=diff.dtype, device=diff.device)
            self._diff_max = local_max if self._diff_max is None else torch.maximum(self._diff_max, local_max)
        return loss, metrics

    def diff_max(self, group) -> float:
        """The largest |rollout - actor| log-prob over every DP rank. Collective when DP > 1: every
        rank calls it (a rank that ran only dummy micro-batches contributes 0)."""
        value = torch.zeros(1, dtype=torch.float64)
        if self._diff_max is not None:
            value = self._diff_max.detach().to(torch.float64).reshape(1)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return float(value)


def on_policy_train_spec(spec, num_samples: int):
    """(the train-loop spec with the wrapped loss and entropy on, the wrapper) for a step whose batch
    has no old log-probs. Raises when the step is not on-policy: skipping the pass would be wrong."""
    if spec.ppo_epochs != 1 or spec.mini_batch_samples_per_rank != num_samples:
        raise ValueError(
            f"update_actor received no old_log_probs, but this rank's {num_samples} samples make "
            f"{num_samples / spec.mini_batch_samples_per_rank:g} mini-batches x {spec.ppo_epochs} epochs; "
            "the on-policy shortcut needs exactly one mini-batch and one epoch"
        )
    wrapper = OnPolicyLoss(spec.loss_fn)
    return dataclasses.replace(spec, loss_fn=wrapper, calculate_entropy=True), wrapper
