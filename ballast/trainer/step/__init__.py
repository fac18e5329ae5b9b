"""The phases of one training step, as the driver (`ballast.trainer.ray_trainer`) runs them.

* `plans`: one `PhasePlan` per phase (old log-probs, reference, values, critic and actor updates),
  each for the objective of the engine that runs it;
* `old_log_probs`: where the old log-probs come from (a separate pass, or the actor update itself);
* `reward`, `dynamic_sampling`: scoring and DAPO's filter-groups sampling;
* `advantage_phase`: scores to rewards (the in-reward KL), rollout correction and advantages, in verl's order;
* `metrics`, `val_metrics`, `monitor`, `charts`: what a step reports.
"""

from ballast.trainer.step.old_log_probs import OldLogProbPhase
from ballast.trainer.step.plans import StepPlanner, phase_objectives

__all__ = ["OldLogProbPhase", "StepPlanner", "phase_objectives"]
