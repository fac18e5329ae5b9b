"""End-to-end run helpers: the tiny task, override lists for a fast 2-worker GRPO on it, and the pieces
the command-line tests share (start the trainer as a subprocess, wait on it, read what it left)."""

import contextlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path


def write_tiny_task(data_dir):
    """The tiny model and a small repeat task (64 train and 8 val rows) written under `data_dir`, as
    {"model", "train", "val"} paths."""
    from ballast.data import write_repeat_dataset
    from ballast.models import tiny_model_dir

    paths = write_repeat_dataset(str(data_dir), train_size=64, val_size=8, seed=0, k_median=6, k_max=20)
    return {"model": str(tiny_model_dir()), "train": str(paths["train"]), "val": str(paths["val"])}


# With overrides(): the default tiny GRPO (two mini-batches per step) with the rollout's log-probs, the
# config of the e2e tests' shared run (tests/e2e/conftest.py, rollout_log_probs_run).
WITH_ROLLOUT_LOG_PROBS = ("actor_rollout_ref.rollout.calculate_log_probs=True",)
# separate_async with one trainer and one rollout worker (the 2-core box); one mini-batch per step, so at a
# step whose batch came from the trainer's current weights the rollout's log-probs equal the actor's
SPLIT_POOLS = ("trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.hybrid_engine=False",
               "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.nnodes=1",
               "actor_rollout_ref.rollout.n_gpus_per_node=1", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
               "trainer.v1.separate_async.parameter_sync_step=1")


# What every GRPO step of the tiny runs reports (one with an old-log-prob pass: two mini-batches)
STEP_METRICS = [
    "global_seqlen/min", "global_seqlen/max", "global_seqlen/minmax_diff", "global_seqlen/balanced_min",
    "global_seqlen/balanced_max", "global_seqlen/mean", "global_workload/balanced_max", "critic/score/mean",
    "critic/rewards/mean", "critic/advantages/mean", "critic/advantages/max", "critic/advantages/min",
    "response_length/mean", "response_length/max", "response_length/min", "response_length/clip_ratio",
    "actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy", "actor/grad_norm", "actor/lr",
    "timing_s/gen", "timing_s/reward", "timing_s/balance", "timing_s/old_log_prob", "timing_s/adv",
    "timing_s/update_actor", "timing_s/step", "perf/throughput_tokens_per_s", "perf/num_micro_batches",
]


def assert_finite(metrics, keys):
    """Every key in `keys` is in `metrics` with a finite value."""
    missing = [k for k in keys if k not in metrics]
    assert not missing, f"missing metrics {missing}"
    bad = {k: metrics[k] for k in keys if not math.isfinite(metrics[k])}
    assert not bad, f"non-finite metrics {bad}"


def overrides(task, run_dir, *extra):
    """A fast 2-worker GRPO configuration on the tiny task."""
    return [
        f"actor_rollout_ref.model.path={task['model']}", f"data.train_files={task['train']}",
        f"data.val_files={task['val']}", f"trainer.default_local_dir={run_dir}",
        "data.max_prompt_length=32", "data.max_response_length=24", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=128",
        "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.rollout.name=hf",
        "algorithm.adv_estimator=grpo", "trainer.device=cpu", "trainer.n_gpus_per_node=2",
        "trainer.logger=[jsonl]", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.resume_mode=disable", "trainer.total_training_steps=2", "trainer.worker_timeout_s=600",
        *extra,
    ]


def run_dir(tmp_path, name):
    path = os.path.join(str(tmp_path), name)
    os.makedirs(path, exist_ok=True)
    return path


def start_trainer(task, run_dir, *extra, env=None):
    """`python -m ballast.trainer.main` on the tiny task (n=2, 2 Ray CPUs) in `run_dir`, with `env`
    added to this process's environment; stdout and stderr are piped as text."""
    # Without RAY_ADDRESS the run starts its own local Ray instead of joining the test session's.
    full_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    full_env.update(env or {}, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    args = overrides(task, run_dir, "actor_rollout_ref.rollout.n=2", "ray_init.num_cpus=2", *extra)
    return subprocess.Popen([sys.executable, "-m", "ballast.trainer.main", *args], cwd=run_dir, env=full_env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@contextlib.contextmanager
def killed_on_exit(proc):
    """Kill `proc` if it is still running when the block ends, so a failed assertion leaves no run behind."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def wait_for(condition, proc, timeout_s, what):
    """Poll `condition` until it holds; fail if `proc` ends first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}:\n{proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s}s"
        time.sleep(0.1)


def last_line(stderr):
    """The last `ballast: ` line of a run's stderr (its one-line verdict), or the tail when there is none."""
    lines = [line for line in stderr.splitlines() if line.startswith("ballast: ")]
    return lines[-1] if lines else stderr[-2000:]


def latest_step(run_dir):
    """The step of the run's latest checkpoint, 0 before the first one."""
    marker = Path(run_dir, "latest_checkpointed_iteration.txt")
    return int(marker.read_text().strip()) if marker.is_file() and marker.read_text().strip() else 0


def logged_steps(run_dir):
    """The steps in the run's metrics.jsonl, in order ([] before the first one)."""
    path = Path(run_dir, "metrics.jsonl")
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
