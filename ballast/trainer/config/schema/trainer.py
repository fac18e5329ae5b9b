"""Schema of the `trainer` and `ray_init` sections: the run itself and the Ray cluster it uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from ballast.trainer.config.schema.choice import choice
from ballast.trainer.config.schema.overlap import BallastOverlapConfig, TrainerV1Config

# The named values of `trainer.resume_mode`; the field stays a string because a checkpoint directory
# is a value too.
ResumeMode = choice("ResumeMode", __name__, "auto", "disable", "resume_path")


@dataclass(frozen=True)
class RolloutRecoveryConfig:
    """Ballast's own keys (verl has no rollout fault tolerance): what the driver does when a rollout worker
    dies, raises from its engine or stops answering (docs/reliability.md, "The rollout side")."""

    max_restarts: int
    """How many times per run the rollout workers may be replaced; the next failure stops the run (exit 3)
    naming the worker. 0: a rollout failure stops the run at once."""
    generate_timeout_s: Optional[float]
    """A generate call still unanswered after this many seconds counts as a hung rollout worker, which is
    replaced; null: only `trainer.worker_timeout_s` bounds it (and stops the run)."""
    health_check_timeout_s: float
    """Before the first call after a failure, and after every replacement, each rollout worker must answer
    a ping within this many seconds."""


@dataclass(frozen=True)
class TrainerConfig:
    device: str
    """`auto` (CUDA when available), `cpu` or `cuda`."""
    nnodes: int
    """Nodes of the run."""
    n_gpus_per_node: int
    """Workers per node (GPUs; on CPU, worker processes)."""
    cpus_per_worker: int
    """CPU cores Ray reserves for each worker process, and its torch/OpenMP threads. On a CPU run the
    cores can go to more processes or to more threads each: one worker of 2 threads needs no gradient
    all-reduce and its vLLM engine reads the weights once per decode step for all its rows."""
    total_epochs: int
    """Passes over the training prompts."""
    total_training_steps: Optional[int]
    """Steps to run; null: epochs x batches per epoch."""
    project_name: str
    """Project name for the loggers and the default run directory."""
    experiment_name: str
    """Experiment name for the loggers and the default run directory."""
    logger: List[str]
    """Any of `console`, `wandb`, `tensorboard`, `jsonl` (metrics.jsonl in the run directory)."""
    balance_batch: bool
    """Reorder each step's samples so every data-parallel rank gets a similar workload."""
    balance_workload: str
    """The cost balanced: `flops` (from the actor's HF config), `verl` (24576 L + L^2) or `tokens`."""
    balance_keep_groups: bool
    """Keep the `n` answers of one prompt on one data-parallel rank when balancing."""
    critic_warmup: int
    """Only the critic trains on steps 1..critic_warmup-1 (verl's count: <= 1 changes nothing)."""
    save_freq: int
    """Save a checkpoint every this many steps and at the last; <= 0: never."""
    test_freq: int
    """Validate every this many steps and at the last; <= 0: never."""
    val_before_train: bool
    """Validate once before the first step."""
    val_only: bool
    """Validate once (needs `data.val_files`) and exit without training."""
    resume_mode: str
    """`auto` (the newest sound checkpoint), `disable`, `resume_path`, or a checkpoint directory."""
    resume_from_path: Optional[str]
    """Checkpoint to resume with `resume_mode=resume_path`."""
    default_local_dir: str
    """Run directory: checkpoints, logs, metrics and the config."""
    max_actor_ckpt_to_keep: Optional[int]
    """Keep this many newest checkpoints; null: all."""
    seed: int
    """Seed of the driver, the workers and the mini-batch shuffles."""
    enable_monitor: bool
    """Log the dynamic-batch monitor lines and plots."""
    monitor_interval: int
    """... at step 1 and every this many steps."""
    worker_timeout_s: float
    """A worker call taking longer is reported (naming the ranks) and the run exits non-zero."""
    max_consecutive_nonfinite_steps: int
    """Non-finite steps skipped in a row before the run stops (exit 4)."""
    save_on_signal: bool
    """On SIGTERM/Ctrl-C: true finishes the step and saves first; false stops at once."""
    move_old_run_aside: bool
    """A fresh start in a directory holding a run: true moves it to `<dir>.old-<time>`; false refuses."""
    use_v1: bool
    """verl's choice of its V1 trainer (true) or its legacy one (false: synchronous and colocated, reading
    no `trainer.v1.*` key; Ballast then runs its synchronous trainer and refuses another `trainer_mode`)."""
    v1: TrainerV1Config
    """verl's V1 trainer modes (docs/off_policy.md)."""
    ballast_overlap: BallastOverlapConfig
    """Ballast's own overlap settings, outside verl's keys (docs/off_policy.md)."""
    ballast_rollout_recovery: RolloutRecoveryConfig
    """Replacing failed rollout workers, outside verl's keys (docs/reliability.md)."""


@dataclass(frozen=True)
class RayInitConfig:
    address: Optional[str]
    """null: start a local Ray instance; `auto` or host:port: join that cluster."""
    num_cpus: Optional[int]
    """CPUs of a local Ray instance; null: all (at least one per worker)."""
    dashboard_host: str
    """Interface the Ray dashboard binds to."""
    timeout_s: float
    """How long to wait for the cluster to answer and to place the workers."""
    worker_env_vars: List[str]
    """Variables of the driver's environment that the workers get beyond those the trainer names (Ballast's
    key; a local Ray's processes start without the rest of it: docs/reliability.md)."""
