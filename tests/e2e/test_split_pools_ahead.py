"""Split resource pools, one batch ahead without partial rollouts (Ballast's whole-batch bound): the
rollout pool generates the next batch while the trainer trains (one update old), validates on the
pool, resumes exactly from a checkpoint; a transfer that loads nothing stops the run naming the cause."""

import json
import os
from pathlib import Path

import pytest

from ballast.trainer.main import EXIT_WORKER_FAILED

from testkit.e2e import SPLIT_POOLS as SPLIT
from testkit.e2e import killed_on_exit, last_line, run_dir, start_trainer

STALENESS = "training/off_policy/trajectory_staleness/max"
# Ballast's whole-batch bound on split pools: the batch ahead finishes on the weights it started with
WHOLE_BATCHES = ("trainer.ballast_overlap.partial_rollout=false",)
BROKEN_SYNC = str(Path(__file__).resolve().parents[1] / "testkit" / "broken_sync")


def _rows(path):
    return [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]


def test_one_batch_ahead_on_split_pools_validates_and_resumes_exactly(session, tmp_path):
    k1 = [*SPLIT, *WHOLE_BATCHES, "trainer.v1.separate_async.num_warmup_batches=1", "trainer.total_training_steps=4",
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
    proc = start_trainer(tiny_task, path, *SPLIT, *WHOLE_BATCHES, "trainer.total_training_steps=3", env=env)
    with killed_on_exit(proc):
        _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == EXIT_WORKER_FAILED, stderr[-3000:]
    reason = last_line(stderr)
    assert "weight sync check failed" in reason and "weight version 1 from the trainer pool" in reason, stderr[-3000:]
