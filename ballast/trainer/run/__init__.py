"""The lifecycle of a run around the step loop: from the command line to the last checkpoint.

* `run_plan`, `builders`: the validated sizes and worker specs, built once (`plan_run`);
* `data`, `preflight`: the data and the start-up checks before any worker exists;
* `workers`: the resource pool and worker groups;
* `run_dir`, `signals`, `checkpoints`, `tracking`: the run directory and its lock, shutdown on
  signals, checkpoints and resume, metrics and logs.
"""

from ballast.trainer.run.run_plan import RunPlan, plan_run

__all__ = ["RunPlan", "plan_run"]
