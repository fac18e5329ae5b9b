"""Ballast's colocated overlap (trainer.ballast_overlap.batches_ahead) through the whole driver loop: one
batch ahead trains every batch after the first on weights one update old, corrects for it, and resumes
from a checkpoint exactly like an uninterrupted run. (Zero ahead is the synchronous trainer itself: the
same code path, nothing to compare.)"""

import json
import os

import pytest

AHEAD = "trainer.ballast_overlap.batches_ahead=1"
STALENESS = "training/off_policy/trajectory_staleness/max"
COMPARED = ["critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "response_length/mean",
            "rollout_corr/k3_kl", STALENESS]


def _deterministic(row):
    """A metrics row without what depends on the machine's speed."""
    return {k: v for k, v in row.items() if not k.startswith(("timing", "perf/", "timestamp"))}


def _rows(tmp_path, name):
    return [json.loads(line) for line in open(os.path.join(tmp_path, name, "metrics.jsonl"))]


def test_one_batch_ahead_trains_on_one_update_old_samples_and_resumes_exactly(session, tmp_path):
    # one mini-batch per step: at step 1 the rollout and the trained policy are the same weights, from
    # step 2 on the batch was generated before the previous update
    extra = [AHEAD, "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
    with session("straight", *extra, "trainer.total_training_steps=4", "trainer.save_freq=2") as trainer:
        assert trainer.correction.bypass  # on by default for stale samples
        trainer.fit()
    rows = _rows(tmp_path, "straight")
    assert [r[STALENESS] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert rows[0]["rollout_corr/k3_kl"] < 1e-6 < min(r["rollout_corr/k3_kl"] for r in rows[1:])  # stale from step 2 on
    assert all(0.0 <= r["perf/trainer_idle_ratio"] <= 1.0 for r in rows)
    checkpoint = os.path.join(tmp_path, "straight", "global_step_2")
    assert os.path.isfile(os.path.join(checkpoint, "rollouts_ahead", "tree.json"))  # step 3's batch, on step 1's weights
    with session("resumed", *extra, "trainer.total_training_steps=4", "trainer.resume_mode=resume_path",
                 f"trainer.resume_from_path={checkpoint}") as trainer:
        assert trainer.global_step == 2
        trainer.fit()
    resumed = {r["step"]: r for r in _rows(tmp_path, "resumed")}
    assert sorted(resumed) == [3, 4]
    for straight in rows[2:]:
        again = resumed[straight["step"]]
        assert set(COMPARED) <= set(again)
        for key, value in _deterministic(straight).items():
            assert again[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
