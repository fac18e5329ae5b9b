"""Faults: a worker killed mid-run stops the driver fast, naming the rank, and `resume_mode=auto`
continues from the last checkpoint; a rank failing because its peer died is reported as the death;
non-finite steps are skipped, counted and stop the run after `max_consecutive_nonfinite_steps`."""

import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ballast.single_controller import Dispatch, Worker, register
from ballast.trainer.config import derive_sizes, load_config
from ballast.trainer.main import EXIT_WORKER_FAILED
from ballast.trainer.run.preflight import resume_point
from ballast.balance import MicroBatchMode, MicroBatchPolicy, plan_phase
from ballast.protocol import Batch
from ballast.trainer.ray_trainer import NonFiniteStepsError, RayPPOTrainer
from ballast.trainer.step.old_log_probs import old_log_prob_source
from ballast.workers.train_loop import UpdateResult

from testkit.e2e import killed_on_exit, last_line, latest_step, overrides, start_trainer, wait_for

SECRETS = {"WANDB_API_KEY": "wandb-secret-3f9a1c", "HF_TOKEN": "hf_secret_77b2e0", "OPENAI_API_KEY": "sk-secret-0d4e"}


# ---------------------------------------------------------------------- non-finite steps (driver logic)
class _FakeActorGroup:
    def __init__(self, skipped):
        self.skipped = list(skipped)
        self.saved, self.loaded = [], []

    def update_actor(self, batch, plan, mode, rest_plan):
        return [UpdateResult({"actor/step_skipped": self.skipped.pop(0), "actor/pg_loss": 0.1,
                              "actor/num_micro_batches": 2.0}, [])]

    def save_checkpoint(self, path):
        self.saved.append(path)

    def load_checkpoint(self, path):
        self.loaded.append(path)

    def __getattr__(self, name):  # other group methods the driver calls around a checkpoint (exports)
        return lambda *args, **kwargs: None


def _driver(tmp_path, skipped, limit, *extra):
    cfg = load_config(overrides({"model": "/m", "train": "/t.parquet", "val": "/v.parquet"}, str(tmp_path),
                                f"trainer.max_consecutive_nonfinite_steps={limit}", "trainer.balance_workload=tokens",
                                "trainer.balance_batch=False",  # the fake group takes no batch to plan
                                *extra))
    data = SimpleNamespace(total_steps=10, state_dict=lambda: {"epoch": 0, "position": 0},
                           load_state_dict=lambda state: None, next_prompts=None)  # no step is launched
    workers = SimpleNamespace(actor_rollout=_FakeActorGroup(skipped), critic=None, rollout=None)
    sizes = derive_sizes(cfg)
    return RayPPOTrainer(cfg, sizes=sizes, data=data, workers=workers, reward=None, tracker=None, model_config={},
                         old_log_probs=old_log_prob_source(cfg, sizes))


def _update(trainer):
    """One actor update through the driver's own method, on a one-row step under verl's separate pass."""
    plan = plan_phase([3], 1, MicroBatchPolicy(MicroBatchMode.STATIC, micro_batch_size=1))
    return trainer.update_actor(Batch({"x": torch.zeros(1, 1)}), plan, plans=None, separate_pass=True)[0]


def test_nonfinite_steps_in_a_row_stop_the_run_at_the_limit(tmp_path):
    trainer = _driver(tmp_path, [1.0, 1.0, 0.0, 1.0, 1.0, 1.0], limit=3)
    for _ in range(5):  # two skipped, a good step resets the streak, then two more skipped: still running
        metrics = _update(trainer)
        assert "actor/step_skipped" in metrics and metrics["perf/num_micro_batches"] == 2.0
    assert trainer._nonfinite_in_a_row == 2
    with pytest.raises(NonFiniteStepsError, match=r"3 actor updates in a row .*max_consecutive_nonfinite_steps=3"):
        _update(trainer)


def test_nonfinite_streak_survives_a_checkpoint(tmp_path):
    trainer = _driver(tmp_path, [1.0, 1.0], limit=3)
    _update(trainer)
    _update(trainer)
    trainer.global_step = 2
    path = trainer.save_checkpoint()
    assert json.load(open(os.path.join(path, "trainer_state.json")))["nonfinite_in_a_row"] == 2
    resumed = _driver(tmp_path, [1.0], 3, "trainer.resume_mode=auto")
    assert resumed.resume(resume_point(resumed.cfg.trainer)) == path and resumed.global_step == 2
    with pytest.raises(NonFiniteStepsError):  # the streak continues: a third skipped update in a row
        _update(resumed)


# ---------------------------------------------------------------------- a peer's death is the root cause
class PeerWorker(Worker):
    """Rank 0 fails at once the way a collective fails when its partner vanishes; rank 1 then dies."""

    @register(Dispatch.ONE_TO_ALL)
    def boom(self):
        if self.rank == 0:
            raise ConnectionError("gloo: Connection closed by peer [127.0.0.1]:29500")
        time.sleep(0.5)
        os._exit(1)


def test_rank_failing_after_its_peer_died_reports_the_death(e2e_ray):
    from ballast.single_controller import RayWorkerGroup, ResourcePool, WorkerDiedError

    e2e_ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this file
    pool = ResourcePool([2], use_gpu=False, name=f"peer_death_{os.getpid()}")
    group = RayWorkerGroup(pool, PeerWorker, name="peers", timeout_s=60)
    try:
        with pytest.raises(WorkerDiedError, match=r"peers\.boom: worker rank 1 died .*worker rank 0 then failed: "
                                                  r".*Connection closed by peer"):
            group.boom()
    finally:
        group.kill()
        pool.remove()


# ---------------------------------------------------------------------- kill a worker, then resume
def _trainer(task, run_dir, *extra):
    return start_trainer(task, run_dir, "trainer.save_freq=1", "trainer.worker_timeout_s=60", *extra, env=SECRETS)


@pytest.mark.slow
def test_killed_worker_stops_the_run_naming_the_rank_and_resume_continues(tiny_task, tmp_path):
    run_dir = str(tmp_path / "faulty")
    os.makedirs(run_dir)
    with killed_on_exit(_trainer(tiny_task, run_dir, "trainer.total_training_steps=3")) as proc:
        wait_for(lambda: latest_step(run_dir) >= 1, proc, 240, "the first checkpoint")
        victim = json.load(open(os.path.join(run_dir, "workers.json")))[1]
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = proc.communicate(timeout=90)
        exit_s = time.monotonic() - killed_at
    assert proc.returncode == EXIT_WORKER_FAILED, stderr[-3000:]
    assert exit_s < 60, f"the driver took {exit_s:.0f}s to notice (trainer.worker_timeout_s=60)"
    reason = last_line(stderr)
    assert reason.startswith("ballast: ") and re.search(r"worker failure: actor_rollout_ref\.\w+: worker rank 1 died",
                                                        reason), stderr[-3000:]
    saved = latest_step(run_dir)
    assert saved >= 1 and os.path.isfile(os.path.join(run_dir, f"global_step_{saved}", "trainer_state.json"))

    logged_before = [json.loads(line)["step"] for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    resumed = _trainer(tiny_task, run_dir, "trainer.total_training_steps=3", "trainer.resume_mode=auto")
    out, err = resumed.communicate(timeout=240)
    assert resumed.returncode == 0, err[-3000:]
    assert f"resumed from {os.path.join(run_dir, f'global_step_{saved}')} at step {saved}" in out
    steps = [json.loads(line)["step"] for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    assert steps[len(logged_before):] == list(range(saved + 1, 4)), "resume must redo only the steps after it"
    assert all(step <= saved for step in logged_before), "a step was logged without its checkpoint"
    _assert_no_secrets(run_dir, out + err + stderr)


def _assert_no_secrets(run_dir, console):
    """No API key from the environment may reach the run directory (configs, metrics, checkpoints) or the logs."""
    leaks = []
    for path in Path(run_dir).rglob("*"):
        if path.is_file():
            blob = path.read_bytes()
            leaks += [f"{path}: {name}" for name, value in SECRETS.items() if value.encode() in blob]
    leaks += [f"console: {name}" for name, value in SECRETS.items() if value in console]
    assert not leaks, leaks
