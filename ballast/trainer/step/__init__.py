"""The phases of one training step, as the driver (`ballast.trainer.ray_trainer`) runs them.

* `plans`: one `PhasePlan` per phase (old log-probs, reference, values, critic and actor updates),
  each for the objective of the engine that runs it;
* `old_log_probs`: where the old log-probs come from (`OldLogProbSource`, decided once: a separate
  pass, the actor update itself, or the rollout in bypass mode), owning the rollout-correction settings;
* `reward`, `dynamic_sampling`: scoring and DAPO's filter-groups sampling;
* `advantage_phase`: scores to rewards (the in-reward KL), rollout correction and advantages, in verl's order;
* `metrics`, `val_metrics`, `monitor`, `charts`: what a step reports.
"""

from ballast.trainer.step.old_log_probs import OldLogProbSource
from ballast.trainer.step.plans import StepPlanner, phase_objectives

__all__ = ["OldLogProbSource", "StepPlanner", "phase_objectives"]
