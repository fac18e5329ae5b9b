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
from testkit.resume import (
    assert_same_parameters, assert_trained_like, deterministic, kill_at, metrics_rows, run_in_process,
)

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


RECOVERY_KEYS = ("rollout/recoveries", "timing_s/rollout_recovery")


def _stopped_processes():
    """pids of this machine's processes stopped by a signal (state T)."""
    import os

    stopped = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[-1].split()[0] == "T":
                    stopped.append(int(pid))
        except OSError:
            continue
    return stopped


@pytest.mark.parametrize("fault, extra", [("kill@3", ()), ("hang@4", ("trainer.ballast_rollout_recovery.generate_timeout_s=20",))],
                         ids=["killed", "hung"])
def test_a_rollout_worker_killed_or_hung_mid_generation_costs_the_run_nothing(fault, extra, uninterrupted, tiny_task,
                                                                             e2e_ray, tmp_path, monkeypatch):
    """The rollout worker dies (SIGKILL) or stops answering (SIGSTOP) while a batch ahead generates:
    the driver replaces it, brings it to the weights that batch was launched under and generates the
    batch again with its own seeds; the run trains every row of the uninterrupted run at the same
    step, logs the same metrics and ends on the same parameters. Nothing is left stopped."""
    monkeypatch.setenv("BALLAST_ROLLOUT_FAULT", fault)
    before = set(_stopped_processes())
    run = run_in_process(tiny_task, run_dir(tmp_path, "faulty"), *AHEAD, *WHOLE_BATCHES, *extra,
                         "ray_init.worker_env_vars=[BALLAST_ROLLOUT_FAULT]")
    assert run.trained == uninterrupted.trained
    # every batch generated under the same weight version as without the fault (the replacement did not
    # serve the model directory's weights); compared with the other metrics below, checked present here
    assert [r["rollout/served_version/min"] for r in uninterrupted.rows] == [0.0, 0.0, 1.0, 2.0, 3.0]
    assert [r["rollout/recoveries"] for r in run.rows].count(1.0) == 1 and sum(r["rollout/recoveries"] for r in run.rows) == 1
    for straight, again in zip(uninterrupted.rows, run.rows):
        expected, got = deterministic(straight), deterministic(again)
        assert sorted(got) == sorted(expected)
        for key, value in expected.items():
            if key not in ENGINE_HISTORY and key not in RECOVERY_KEYS:
                assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (straight["step"], key)
    assert_same_parameters(uninterrupted, run)
    assert not set(_stopped_processes()) - before
