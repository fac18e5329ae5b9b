"""Old log-probs from the actor update itself, wherever the update still runs the sampling policy.

The first mini-batch of the first epoch is differentiated under exactly the weights that generated
the samples: its "old" log-probs are its own log-probs, detached (the PPO ratio is then exactly 1 and
its gradient the plain policy gradient, as with a separate pass, within float rounding). The rows of
the later mini-batches need theirs before the first optimizer step changes the weights: the update
computes them in a forward-only pass over exactly those rows first. So the step needs no separate
old-log-prob phase on the driver: one dispatch less, and the first mini-batch's rows are not run
twice. verl 0.9.1 always runs the separate pass (only its rollout-correction bypass mode skips it, taking
the rollout's own log-probs instead); `actor.old_log_prob_from_update=False` runs it here too.

Which rows are "first" is read off the actor's `PhasePlan` (its first mini-batch); the update returns
the log-probs and entropies of all its rows in its typed result (`UpdateResult.old_log_probs`,
`.entropy`), and the driver computes every metric of the pass (entropy, rollout-vs-actor difference)
over all rows exactly as after a separate pass.

Rollout correction decides too: its decoupled mode needs the old log-probs on the driver before the
update (a separate pass, "pass"); its bypass mode takes the rollout's log-probs as the old policy and
runs no old-log-prob pass at all ("rollout"); the update then returns the log-probs each row had when
it was trained (`LogProbRecorder`), the actor side of the mismatch metrics.
"""

from __future__ import annotations

import enum
from typing import Dict, List

import numpy as np
import torch

from ballast.engine.losses import mini_batch_statistic
from ballast.engine.micro_batch import restore_order

OLD_LOG_PROBS_KEY = "old_log_probs"


class OldLogProbMode(str, enum.Enum):
    """Where a step's old log-probs come from: a separate pass over every row ("pass", verl's way),
    the update alone ("update": one mini-batch, nothing else to compute) or the update plus a
    forward-only pass inside it over the rows after its first mini-batch ("partial")."""

    PASS = "pass"
    PARTIAL = "partial"
    UPDATE = "update"
    ROLLOUT = "rollout"  # bypass mode: the rollout's log-probs are the old policy; no pass anywhere

    @property
    def from_update(self) -> bool:
        """Whether the update computes (and returns) the old log-probs."""
        return self in (OldLogProbMode.PARTIAL, OldLogProbMode.UPDATE)


def old_log_prob_mode(num_mini_batches: int, ppo_epochs: int, use_kl_in_reward: bool, enabled: bool,
                      needed_before_update: bool = False, rollout_is_old: bool = False) -> OldLogProbMode:
    """The mode of a run. A reward KL penalty needs the old log-probs before the update (to build the
    rewards), and so does decoupled rollout correction (`needed_before_update`: its weights and masks
    are made on the driver); with several epochs the first mini-batch comes back under updated
    weights: each rules the shortcut out, as does switching it off. Bypass rollout correction
    (`rollout_is_old`) makes no pass: the rollout's log-probs serve."""
    if rollout_is_old:
        return OldLogProbMode.ROLLOUT
    if not enabled or ppo_epochs != 1 or use_kl_in_reward or needed_before_update:
        return OldLogProbMode.PASS
    return OldLogProbMode.UPDATE if num_mini_batches == 1 else OldLogProbMode.PARTIAL


class SelfOldLogProbLoss:
    """Wraps an actor loss for the first mini-batch: old log-probs := the micro-batch's own log-probs,
    detached; keeps them and the entropies, in the order the engine runs the micro-batches."""

    def __init__(self, loss_fn) -> None:
        self.loss_fn = loss_fn
        self._log_probs: List[torch.Tensor] = []
        self._entropy: List[torch.Tensor] = []

    @property
    def mini_batch_statistic(self):  # the wrapped loss's (see ballast.engine.losses)
        return mini_batch_statistic(self.loss_fn)

    def __call__(self, outputs: Dict[str, torch.Tensor], micro, norm):
        log_probs = outputs["log_probs"].detach()
        micro = micro.copy()
        micro.set(OLD_LOG_PROBS_KEY, log_probs)
        # Kept on the device, moved to the host once in `collect`: no host sync per micro-batch.
        self._log_probs.append(log_probs)
        self._entropy.append(outputs["entropy"].detach())
        return self.loss_fn(outputs, micro, norm)

    def collect(self, micro_batches: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs, entropies) of the first mini-batch's rows, in row order; `micro_batches` is this
        rank's part of the mini-batch plan the engine executed."""
        real = tuple(rows for rows in micro_batches if len(rows))
        if len(real) != len(self._log_probs):
            raise AssertionError(f"the loss saw {len(self._log_probs)} micro-batches, the plan has {len(real)}")
        return restore_order(self._log_probs, real).cpu(), restore_order(self._entropy, real).cpu()


class LogProbRecorder:
    """Wraps a loss and keeps the log-probs each micro-batch had when it was trained (detached, in
    the order the engine runs the micro-batches); `collect` puts them in row order."""

    def __init__(self, loss_fn) -> None:
        self.loss_fn = loss_fn
        self._log_probs: List[torch.Tensor] = []

    @property
    def mini_batch_statistic(self):
        return mini_batch_statistic(self.loss_fn)

    def __call__(self, outputs: Dict[str, torch.Tensor], micro, norm):
        self._log_probs.append(outputs["log_probs"].detach())
        return self.loss_fn(outputs, micro, norm)

    def collect(self, micro_batches: tuple, width: int) -> torch.Tensor:
        """Log-probs (rows, `width`) of the mini-batch's rows on this rank, in row order, on the host."""
        real = tuple(rows for rows in micro_batches if len(rows))
        if len(real) != len(self._log_probs):
            raise AssertionError(f"the loss saw {len(self._log_probs)} micro-batches, the plan has {len(real)}")
        if not real:  # this rank held no row of the mini-batch (zero-weight micro-batches only)
            return torch.zeros(0, width)
        return restore_order(self._log_probs, real).cpu()


def rows_after_first(plan, dp_rank: int) -> np.ndarray:
    """This rank's row positions (in its dispatched data) after its first mini-batch."""
    first = plan.mini_batches[0].rows_per_rank[dp_rank]
    return np.arange(first, sum(mb.rows_per_rank[dp_rank] for mb in plan.mini_batches))
