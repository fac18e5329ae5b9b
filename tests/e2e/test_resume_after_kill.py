"""Colocated overlap two batches ahead (trainer.ballast_overlap.batches_ahead=2): a driver SIGKILLed
while the batches ahead are generating, resumed with `resume_mode=auto`, trains exactly the rows
the uninterrupted run trains at every step, logs the same metrics and ends on the same parameters;
it continues from its checkpoint, never from step 0."""

import pytest

from testkit.resume import assert_same_parameters, assert_trained_like, deterministic, kill_at, run_in_process
from testkit.e2e import run_dir

# one mini-batch per step: from step 2 on the batches were generated before the previous updates
K2 = ("trainer.ballast_overlap.batches_ahead=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
      "trainer.total_training_steps=5", "trainer.save_freq=1")
STALENESS = "training/off_policy/trajectory_staleness/max"


@pytest.fixture(scope="module")
def uninterrupted(tiny_task, e2e_ray, tmp_path_factory):
    return run_in_process(tiny_task, run_dir(tmp_path_factory.mktemp("k2"), "straight"), *K2)


def test_two_ahead_killed_while_generating_resumes_exactly(uninterrupted, tiny_task, e2e_ray, tmp_path):
    assert [r[STALENESS] for r in uninterrupted.rows] == [0.0, 1.0, 2.0, 2.0, 2.0]
    path = run_dir(tmp_path, "killed")
    # after step 2's update step 5 is generating, steps 3 and 4 wait generated: the checkpoint of step 1
    # holds the batches of steps 2-4 and the data position past step 4's prompts
    saved = kill_at(tiny_task, path, "generating", 2, *K2)
    assert saved == 1
    resumed = run_in_process(tiny_task, path, *K2, "trainer.resume_mode=auto")
    assert_trained_like(uninterrupted, resumed, saved)
    assert_same_parameters(uninterrupted, resumed)


def test_an_engine_failing_inside_a_colocated_worker_is_rebuilt_in_place_and_costs_nothing(
        uninterrupted, tiny_task, e2e_ray, tmp_path, monkeypatch):
    """The rollout engine of rank 1 raises when step 3's generation (two batches ahead) starts: the
    worker, whose actor and optimizer state live on, builds a new engine, brings it to the actor's
    weights and generates the chunk again with its own seeds; every row, metric and parameter of the
    run equals the uninterrupted run's."""
    monkeypatch.setenv("BALLAST_ROLLOUT_FAULT", "raise@3:1")
    run = run_in_process(tiny_task, run_dir(tmp_path, "faulty"), *K2, "ray_init.worker_env_vars=[BALLAST_ROLLOUT_FAULT]")
    assert run.trained == uninterrupted.trained
    assert [r["rollout/recoveries"] for r in run.rows] == [0.0, 0.0, 1.0, 0.0, 0.0]
    for straight, again in zip(uninterrupted.rows, run.rows):
        expected, got = deterministic(straight), deterministic(again)
        assert sorted(got) == sorted(expected)
        for key, value in expected.items():
            if key != "rollout/recoveries" and not key.startswith("rollout/sync_check"):
                assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (straight["step"], key)
    assert_same_parameters(uninterrupted, run)
