"""Split pools (separate_async, one batch ahead) killed with SIGKILL and resumed with
`resume_mode=auto`. Without partial rollouts, a driver killed right after an update (its weights not
yet sent to the rollout pool) resumes exactly: the rows trained at every step, every per-step
metric but the timing ones and the final parameters equal the uninterrupted run's. With partial
rollouts (the weights reach the generations in flight through the mailbox; where they land is
timing), the resumed run still trains every prompt once, at its own step, and no token is staler
than the bound."""

from collections import Counter

import pytest

from testkit.e2e import SPLIT_POOLS, run_dir
from testkit.resume import assert_same_parameters, assert_trained_like, kill_at, metrics_rows, run_in_process

AHEAD = (*SPLIT_POOLS, "trainer.v1.separate_async.num_warmup_batches=1", "trainer.total_training_steps=5")
WHOLE_BATCHES = ("trainer.ballast_overlap.partial_rollout=false", "trainer.save_freq=1")
OFF = "training/off_policy"
# The weight-sync check's distance from the weights the rollout engine served before the ones it loads:
# after a resume whose first batches come from the checkpoint, that is the weights the pool started
# with, not the previous step's (the batches it generated before the kill are gone with the kill).
ENGINE_HISTORY = ("rollout/sync_check/served_vs_previous", "rollout/sync_check/update_effect")


@pytest.fixture(scope="module")
def uninterrupted(tiny_task, e2e_ray, tmp_path_factory):
    return run_in_process(tiny_task, run_dir(tmp_path_factory.mktemp("split"), "straight"), *AHEAD, *WHOLE_BATCHES)


def test_split_pools_killed_after_an_update_resume_exactly(uninterrupted, tiny_task, e2e_ray, tmp_path):
    assert [r[f"{OFF}/trajectory_staleness/max"] for r in uninterrupted.rows] == [0.0, 1.0, 1.0, 1.0, 1.0]
    path = run_dir(tmp_path, "killed")
    saved = kill_at(tiny_task, path, "updated", 2, *AHEAD, *WHOLE_BATCHES)
    assert saved == 1  # holding step 2's batch and step 3's, generated on the rollout pool
    resumed = run_in_process(tiny_task, path, *AHEAD, *WHOLE_BATCHES, "trainer.resume_mode=auto")
    assert_trained_like(uninterrupted, resumed, saved, not_compared=ENGINE_HISTORY)
    assert_same_parameters(uninterrupted, resumed)


def test_partial_rollouts_killed_after_an_update_train_every_prompt_once(uninterrupted, tiny_task, e2e_ray,
                                                                          tmp_path):
    loops = tmp_path / "loops.yaml"
    loops.write_text("- name: waiting\n  _target_: testkit.agent.WaitingLoop\n")  # 1 s between turns
    partial = [*AHEAD, "actor_rollout_ref.rollout.mode=async", f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
               "actor_rollout_ref.rollout.agent.default_agent_loop=waiting", "data.max_response_length=32",
               "trainer.save_freq=2", "trainer.total_training_steps=4"]
    path = run_dir(tmp_path, "killed")
    # the checkpoint of step 2 holds the batches of steps 3 and 4, generated while updates landed
    saved = kill_at(tiny_task, path, "updated", 3, *partial)
    assert saved == 2
    resumed = run_in_process(tiny_task, path, *partial, "trainer.resume_mode=auto")
    assert resumed.resumed_at == saved and sorted(resumed.trained) == [3, 4]
    for step, rows in resumed.trained.items():
        # every prompt of the step n=2 times under its own uid, the rows the data order gives the step
        assert Counter(uid for _, uid in rows) == {f"step{step}-{i}": 2 for i in range(4)}, step
        assert rows == uninterrupted.trained[step], step
    rows = metrics_rows(path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # the killed run's rows, then the resumed steps once
    for r in rows:
        assert r[f"{OFF}/trajectory_staleness_worst/max"] <= 1, r  # every token within the bound
    # the mailbox was used: an update reached a generation in flight (1 s waits against ~0.1 s updates)
    assert any(r["rollout/partial/weight_loads"] >= 1 for r in rows), rows
