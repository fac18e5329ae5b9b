"""Old log-probs from the update's own forward, wherever the update still runs the old policy.

The first mini-batch of the first epoch is differentiated under exactly the weights that generated
the samples: its "old" log-probs are its own log-probs, detached. So the driver's separate
old-log-prob pass need not cover those rows:

* one mini-batch and one epoch: no pass at all (verl 0.9.1 still runs its pass then; it skips it only
  in rollout-correction bypass mode, which uses the rollout's own log-probs instead);
* k > 1 mini-batches, one epoch, a central plan: the pass covers the other (k - 1) / k of the rows.

The driver marks the rows with `FROM_UPDATE_KEY` (bool, per row); for them `old_log_probs` in the
batch is a placeholder. The loss wrapper swaps in the detached log-probs (the PPO ratio is then
exactly 1 and its gradient the plain policy gradient, as with a separate pass, within float rounding)
and keeps each marked row's log-probs and entropy, which the update returns so that the driver
fills the batch and computes every metric of the pass (entropy, rollout-vs-actor difference) over
all rows exactly as before.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional

import numpy as np
import torch

OLD_LOG_PROBS_KEY = "old_log_probs"
ROLLOUT_LOG_PROBS_KEY = "rollout_log_probs"
FROM_UPDATE_KEY = "old_log_probs_from_update"
ROW_INDEX_KEY = "row_index"  # the row's position in this rank's data, to send its log-probs back


def first_mini_batch_mode(num_mini_batches: int, ppo_epochs: int, use_kl_in_reward: bool,
                          central_plan: bool) -> str:
    """How the step gets its old log-probs: "update" (no pass: one mini-batch, one epoch), "partial"
    (the pass skips the first mini-batch, whose rows the driver must know: needs a central plan) or
    "pass" (a separate pass over every row).

    A reward KL penalty needs the old log-probs before the update (to build the rewards), and with
    several epochs the first mini-batch comes back under updated weights: both rule the shortcut out.
    """
    if ppo_epochs != 1 or use_kl_in_reward:
        return "pass"
    if num_mini_batches == 1:
        return "update"
    return "partial" if central_plan else "pass"


class UpdateLogProbLoss:
    """Wraps an actor loss: for rows marked `FROM_UPDATE_KEY`, old log-probs := the micro-batch's own
    log-probs, detached; their log-probs and entropies are kept (`collect`)."""

    def __init__(self, loss_fn) -> None:
        self.loss_fn = loss_fn
        self._rows: List[torch.Tensor] = []
        self._log_probs: List[torch.Tensor] = []
        self._entropy: List[torch.Tensor] = []

    def __call__(self, outputs: Dict[str, torch.Tensor], micro, norm):
        marked = micro[FROM_UPDATE_KEY].bool()
        log_probs = outputs["log_probs"].detach()
        micro = micro.copy()
        micro.set(OLD_LOG_PROBS_KEY, torch.where(marked[:, None], log_probs, micro[OLD_LOG_PROBS_KEY]))
        # Kept on the device, moved to the host once in `collect`: no host sync per micro-batch.
        self._rows.append(micro[ROW_INDEX_KEY][marked])
        self._log_probs.append(log_probs[marked])
        self._entropy.append(outputs["entropy"].detach()[marked])
        return self.loss_fn(outputs, micro, norm)

    def collect(self) -> Optional["UpdateLogProbs"]:
        """The marked rows seen so far (each once, in row order), or None when there were none."""
        rows = torch.cat(self._rows).cpu() if self._rows else torch.zeros(0, dtype=torch.long)
        if not len(rows):
            return None
        order = torch.argsort(rows)
        if len(torch.unique(rows)) != len(rows):
            raise AssertionError("a row marked for update log-probs ran twice: was it in several mini-batches?")
        return UpdateLogProbs(rows=rows[order].numpy(), old_log_probs=torch.cat(self._log_probs).cpu()[order],
                              entropy=torch.cat(self._entropy).cpu()[order])


@dataclasses.dataclass
class UpdateLogProbs:
    """Log-probs and entropies the update computed for the marked rows of one rank's data."""

    rows: np.ndarray               # positions in this rank's dispatched data
    old_log_probs: torch.Tensor    # (len(rows), R)
    entropy: torch.Tensor          # (len(rows), R)


def check_marked_rows(marked: torch.Tensor, mini_batch_samples: int, ppo_epochs: int,
                      shuffled_per_rank: bool) -> None:
    """Raise unless every marked row is trained in the first mini-batch of the first epoch, the only
    place where the update's forward still runs the policy that generated the samples."""
    if not bool(marked.any()):
        return
    first_only = not bool(marked[mini_batch_samples:].any())
    whole_is_first = len(marked) == mini_batch_samples
    if ppo_epochs != 1 or not (whole_is_first or (first_only and not shuffled_per_rank)):
        raise ValueError(
            f"update_actor: {int(marked.sum())} rows without old log-probs (marked {FROM_UPDATE_KEY!r}), but "
            f"this rank's {len(marked)} samples make {len(marked) / mini_batch_samples:g} mini-batches x "
            f"{ppo_epochs} epochs and the marked rows are not all in the first mini-batch of the first epoch"
        )


def update_log_prob_train_spec(spec):
    """(the train-loop spec with the wrapped loss and entropy on, the wrapper)."""
    wrapper = UpdateLogProbLoss(spec.loss_fn)
    return dataclasses.replace(spec, loss_fn=wrapper, calculate_entropy=True), wrapper
