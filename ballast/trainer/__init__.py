"""The driver side of Ballast.

* `main`: the command line (`python -m ballast.trainer.main`, hydra overrides);
* `ray_trainer`: `RayPPOTrainer.fit()`, the loop that calls one function per phase;
* `step/`: the phases of one step (plans, old log-probs, reward, metrics);
* `run/`: the run's lifecycle (config to specs, workers, run directory, signals, checkpoints, tracking);
* `config/`: the typed config, its validation and the derived sizes;
* `algorithms/`: advantages, policy and value losses, KL (registries of real families).
"""
