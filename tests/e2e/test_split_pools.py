"""Split resource pools (trainer.v1.trainer_mode=separate_async): a trainer group without a rollout and a
rollout-only group on a pool of its own, the weights crossing through Ray's object store after every
update. Zero batches ahead keeps the rollout on the trainer's current weights at every step; one ahead
generates the next batch on the rollout pool while the trainer trains, one update old; a transfer that
loads nothing stops the run naming the cause."""

import json
import os
from pathlib import Path

import pytest

from ballast.trainer.main import EXIT_WORKER_FAILED

from testkit.e2e import WITH_ROLLOUT_LOG_PROBS, killed_on_exit, last_line, run_dir, start_trainer

# one trainer and one rollout worker (the 2-core box); one mini-batch per step, so at a step whose
# batch was generated with the trainer's current weights the rollout's log-probs equal the actor's
SPLIT = ["trainer.v1.trainer_mode=separate_async", "actor_rollout_ref.hybrid_engine=False",
         "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
         "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.v1.separate_async.parameter_sync_step=1"]
STALENESS = "training/off_policy/trajectory_staleness/max"
BROKEN_SYNC = str(Path(__file__).resolve().parents[1] / "testkit" / "broken_sync")


def _rows(path):
    return [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]


def test_split_pools_sample_with_the_trainers_weights(session, tmp_path):
    k0 = [*SPLIT, *WITH_ROLLOUT_LOG_PROBS, "trainer.v1.separate_async.num_warmup_batches=0",
          "trainer.total_training_steps=3"]
    with session("k0", *k0) as trainer:
        assert trainer.workers.rollout is not None and trainer.workers.actor_rollout.world_size == 1
        assert not trainer.correction.bypass  # nothing is stale
        trainer.fit()
    rows = _rows(os.path.join(tmp_path, "k0"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # every batch came from the weights being trained: the transfer ran before each generation
        assert r["rollout_corr/k3_kl"] < 1e-6, r["rollout_corr/k3_kl"]
        assert r["rollout/sync_check/mean_abs_diff"] < 1e-5 and r["timing_s/export_weights"] > 0
        assert STALENESS not in r


def test_one_batch_ahead_on_split_pools_validates_and_resumes_exactly(session, tmp_path):
    k1 = [*SPLIT, "trainer.v1.separate_async.num_warmup_batches=1", "trainer.total_training_steps=4",
          "trainer.val_before_train=True", "trainer.test_freq=2", "trainer.save_freq=2"]
    with session("k1", *k1) as trainer:
        assert trainer.rollouts.ahead == 1 and trainer.correction.bypass  # stale samples: corrected by default
        trainer.fit()
    rows = _rows(os.path.join(tmp_path, "k1"))
    steps = [r for r in rows if STALENESS in r]
    assert [r[STALENESS] for r in steps] == [0.0, 1.0, 1.0, 1.0]
    assert steps[0]["rollout_corr/k3_kl"] < 1e-6 < min(r["rollout_corr/k3_kl"] for r in steps[1:])  # stale from step 2
    # the initial weights went with the validation before training, and step 2's batch was launched with
    # step 1's, before any update: the weights (and their check) came with the batches of steps 3 and 4
    checked = [r.get("rollout/sync_check/mean_abs_diff") for r in steps]
    assert [c is not None for c in checked] == [False, False, True, True] and max(c or 0 for c in checked) < 1e-5
    # validation on the rollout pool: before training and at steps 2 and 4
    assert sorted(r["step"] for r in rows if "val/score/mean" in r) == [0, 2, 4]
    # a run resumed from step 2 (the trainer's weights go to the rollout pool first) continues exactly
    checkpoint = os.path.join(tmp_path, "k1", "global_step_2")
    with session("resumed", *k1, "trainer.resume_mode=resume_path", f"trainer.resume_from_path={checkpoint}") as trainer:
        assert trainer.global_step == 2
        trainer.fit()
    resumed = {r["step"]: r for r in _rows(os.path.join(tmp_path, "resumed")) if STALENESS in r}
    assert sorted(resumed) == [3, 4]
    for straight in steps[2:]:
        again = resumed[straight["step"]]
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "rollout_corr/k3_kl", STALENESS):
            assert again[key] == pytest.approx(straight[key], rel=1e-5, abs=1e-7), key


def test_a_transfer_that_loads_nothing_stops_the_run_naming_the_cause(tiny_task, tmp_path):
    path = run_dir(tmp_path, "split_broken")
    env = {"PYTHONPATH": os.pathsep.join([BROKEN_SYNC, os.environ.get("PYTHONPATH", "")]),
           "BALLAST_TEST_BREAK_SYNC": "load_weights"}
    proc = start_trainer(tiny_task, path, *SPLIT, "trainer.total_training_steps=3", env=env)
    with killed_on_exit(proc):
        _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == EXIT_WORKER_FAILED, stderr[-3000:]
    reason = last_line(stderr)
    assert "weight sync check failed" in reason and "weight version 1 from the trainer pool" in reason, stderr[-3000:]
