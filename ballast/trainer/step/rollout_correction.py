"""The driver's side of rollout correction: settings from the config, and what each step does with them.

`algorithm.rollout_correction` (verl's keys) is parsed and checked by `rollout_correction_settings`
(errors name the key), called once per run, by `ballast.trainer.step.old_log_probs.old_log_prob_source`:
the run's `OldLogProbSource` owns the result, and everything else takes the settings from it. Per
step (`RolloutCorrectionPhase`):

* bypass mode: the rollout's log-probs are the old policy, read from their own column,
  `rollout_log_probs`, by everything that needs the old policy (the reward KL, the loss); no
  old-log-prob pass runs (`OldLogProbMode.ROLLOUT`) and no `old_log_probs` column exists; the loss
  computes weights and rejection from the policy being trained, and the update returns the log-probs
  each row had when it was trained, from which the metrics are computed here;
* decoupled mode with a correction: after the ONE old-log-prob pass and before the advantages (as
  verl), every row gets its importance weights (`rollout_is_weights`, not batch-normalised, with the
  row's terms of the batch mean: `rollout_is_norm_sum` / `_count`) and the rejection is applied to
  `response_mask`; the loss divides by the mini-batch-global mean, which the engine sums over exactly
  the mini-batch it trains, across every DP rank;
* no correction (the default): the mismatch metrics alone, whenever the rollout reported log-probs.

Metrics are verl's `rollout_corr/*`, computed over the whole step (bypass: over each row's log-probs
at the moment it was trained, first epoch); `rollout_corr/rollout_is_batch_norm_factor` is the mean of
the per-mini-batch normalisers.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from ballast.balance import PhasePlan
from ballast.protocol import Batch
from ballast.trainer.algorithms.rollout_correction import (KEY, RolloutCorrection, correct, normaliser,
                                                           normaliser_terms, parse_rollout_correction)
from ballast.trainer.algorithms.rollout_correction_metrics import PREFIX, correction_metrics
from ballast.trainer.config.loader import ConfigError
from ballast.workers.rollout.base import BACKENDS_WITH_LOG_PROBS

ROLLOUT = "actor_rollout_ref.rollout"
NORM_KEYS = ("rollout_is_norm_sum", "rollout_is_norm_count")


def rollout_correction_settings(cfg) -> RolloutCorrection:
    """`algorithm.rollout_correction` parsed, with the rules that involve other keys; ConfigError names
    the key."""
    rc = cfg.algorithm.rollout_correction
    try:
        corr = parse_rollout_correction(rc.rollout_is, rc.rollout_is_threshold, rc.rollout_is_batch_normalize,
                                        rc.rollout_rs, rc.rollout_rs_threshold, rc.bypass_mode, rc.loss_type)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    rollout = cfg.actor_rollout_ref.rollout
    needs = [f"{KEY}.bypass_mode=true"] if corr.bypass_mode else []
    needs += [f"{KEY}.{k}={getattr(rc, k)!r}" for k in ("rollout_is", "rollout_rs") if getattr(rc, k) is not None]
    if needs and rollout.name not in BACKENDS_WITH_LOG_PROBS:
        raise ConfigError(f"{needs[0]} needs the rollout's log-probs, which {ROLLOUT}.name={rollout.name!r} does not "
                          f"report (backends that do: {', '.join(BACKENDS_WITH_LOG_PROBS)})")
    if needs and not rollout.calculate_log_probs:
        raise ConfigError(f"{needs[0]} needs the rollout's log-prob of every sampled token: set "
                          f"{ROLLOUT}.calculate_log_probs=True")
    loss_mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    if corr.bypass_mode and loss_mode != "vanilla":
        raise ConfigError(f"{KEY}.bypass_mode=true trains with {KEY}.loss_type ({corr.loss_type}) against the rollout "
                          f"policy and replaces actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode!r}: set it "
                          "to vanilla, or bypass_mode=false")
    return corr


def loss_correction(corr: RolloutCorrection) -> Optional[RolloutCorrection]:
    """What the actor loss needs to know: None unless the loss itself applies something."""
    return corr if corr.bypass_mode or corr.rollout_is is not None else None


def scatter_rows(parts: Sequence[torch.Tensor], rows: Sequence[np.ndarray], num_rows: int) -> torch.Tensor:
    """Per-rank tensors (each rank's `rows` in order) into one (num_rows, ...) tensor in step order."""
    first = next(p for p in parts if p is not None and p.numel())
    out = torch.zeros((num_rows,) + tuple(first.shape[1:]), dtype=first.dtype)
    for part, index in zip(parts, rows):
        if len(index):
            out[torch.as_tensor(index)] = part
    return out


class RolloutCorrectionPhase:
    """Applies one run's rollout-correction settings to each step's batch (see the module docstring)."""

    def __init__(self, corr: RolloutCorrection) -> None:
        self.corr = corr

    @property
    def bypass(self) -> bool:
        return self.corr.bypass_mode

    def before_advantages(self, batch: Batch) -> Dict[str, float]:
        """Decoupled mode with a correction: weights and rejection from the old log-probs; metrics."""
        if not self.corr.needs_old_log_probs_before_update:
            return {}
        mask = batch["response_mask"]
        old, rollout = batch["old_log_probs"], batch["rollout_log_probs"]
        c = correct(old, rollout, mask, self.corr)
        metrics = correction_metrics(old, rollout, mask, self.corr, c)
        if c.weights is not None:
            batch["rollout_is_weights"] = c.weights.weights.to(torch.float32)
            terms = normaliser_terms(c.weights.weights, mask, self.corr.rollout_is)
            batch[NORM_KEYS[0]], batch[NORM_KEYS[1]] = terms[:, 0].clone(), terms[:, 1].clone()
        batch["response_mask"] = c.mask
        return metrics

    def after_update(self, batch: Batch, plan: Optional[PhasePlan], results: Optional[Sequence]) -> Dict[str, float]:
        """Metrics that need the update: bypass mode's (from the log-probs rows were trained with), the
        batch normalisers of the mini-batches, and the mismatch metrics without a correction."""
        if self.bypass:
            return self._bypass_metrics(batch, plan, results) if results is not None else {}
        if self.corr.needs_old_log_probs_before_update:
            if plan is None or not self.corr.batch_normalize:
                return {}
            terms = torch.stack([batch[k] for k in NORM_KEYS], dim=-1)
            return self._norm_factor(terms, [np.concatenate(plan.partitions(m)) for m in range(len(plan.mini_batches))])
        if "rollout_log_probs" not in batch or "old_log_probs" not in batch:
            return {}
        mask = batch["response_mask"]
        c = correct(batch["old_log_probs"], batch["rollout_log_probs"], mask, self.corr)
        return correction_metrics(batch["old_log_probs"], batch["rollout_log_probs"], mask, self.corr, c)

    def _bypass_metrics(self, batch: Batch, plan: PhasePlan, results: Sequence) -> Dict[str, float]:
        per_epoch = len(plan.mini_batches) // plan.epochs
        ranks = [np.concatenate([plan.partitions(m)[r] for m in range(per_epoch)]) for r in range(plan.dp_size)]
        parts = [result.train_log_probs for result in results]
        if any(p is None for p in parts):
            raise RuntimeError("bypass mode: the actor update returned no train-time log-probs")
        trained = scatter_rows(parts, ranks, len(batch))
        batch["train_log_probs"] = trained
        mask, rollout = batch["response_mask"], batch["rollout_log_probs"]
        c = correct(trained, rollout, mask, self.corr)
        metrics = correction_metrics(trained, rollout, mask, self.corr, c)
        if self.corr.batch_normalize and c.weights is not None:
            terms = normaliser_terms(c.weights.weights, mask, self.corr.rollout_is)
            metrics.update(self._norm_factor(terms, [np.concatenate(plan.partitions(m)) for m in range(per_epoch)]))
        return metrics

    def _norm_factor(self, terms: torch.Tensor, mini_batches: List[np.ndarray]) -> Dict[str, float]:
        """The mean over mini-batches of each one's normaliser (1 where it was ~0, as the loss uses)."""
        factors = []
        for rows in mini_batches:
            mean = normaliser(terms[torch.as_tensor(rows)].sum(0), self.corr.rollout_is)
            factors.append(mean if mean > 1e-8 else 1.0)
        return {PREFIX + "rollout_is_batch_norm_factor": float(np.mean(factors))}

