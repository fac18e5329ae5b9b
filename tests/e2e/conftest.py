"""End-to-end runs share the session Ray instance, the cached tiny model and a small synthetic task, and
one three-step GRPO run that several tests assert different things about."""

import json
import os

import pytest

from testkit.e2e import WITH_ROLLOUT_LOG_PROBS, overrides, run_dir, write_tiny_task


@pytest.fixture(scope="session")
def e2e_ray(ray_session):
    return ray_session


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory):
    return write_tiny_task(tmp_path_factory.mktemp("repeat"))




@pytest.fixture(scope="session")
def rollout_log_probs_run(tiny_task, e2e_ray, tmp_path_factory):
    """Three steps of the default tiny GRPO with WITH_ROLLOUT_LOG_PROBS and a checkpoint every two steps
    (steps 2 and 3; saving changes no weight and no logged value but its timing), run once for the
    session: {"mode": the old-log-prob mode, "final": the last step's metrics, "rows": every step's
    logged metrics, "fingerprint": the actor's final sum |w|, "dir": its run directory}. Its users: the
    two-mini-batch old-log-prob check, the resume test (the uninterrupted run, and its step-2
    checkpoint to resume from) and the async-rollout comparison (the batched run's step 2); a training
    session costs ~10 s."""
    from ballast.trainer.config import load_config
    from ballast.trainer.main import prepare_typed, training_session

    path = run_dir(tmp_path_factory.mktemp("shared"), "rollout_log_probs")
    cfg = load_config(overrides(tiny_task, path, *WITH_ROLLOUT_LOG_PROBS, "trainer.total_training_steps=3",
                                "trainer.save_freq=2"))
    with training_session(prepare_typed(cfg)) as trainer:
        mode = trainer.old_log_probs.mode
        final = trainer.fit()
        fingerprint = trainer.workers.actor_rollout.actor_state_fingerprint()[0]
    with open(os.path.join(path, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {"mode": mode, "final": final, "rows": rows, "fingerprint": fingerprint, "dir": path}


@pytest.fixture()
def session(tiny_task, e2e_ray, tmp_path):
    """`session(name, *overrides)`: a training session of the fast tiny GRPO run in `tmp_path/name`."""
    from ballast.trainer.config import load_config
    from ballast.trainer.main import prepare_typed, training_session

    def make(name, *extra):
        return training_session(prepare_typed(load_config(overrides(tiny_task, run_dir(tmp_path, name), *extra))))

    return make
