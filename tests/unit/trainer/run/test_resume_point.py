"""`trainer.resume_mode` keeps what the user wrote; pre-flight turns it into one typed `ResumePoint`
(a verified checkpoint and its step, or a fresh start), and a rerun never overwrites a run it cannot
continue: `auto` with no usable checkpoint in a directory that holds a run is refused like `disable`
(or moves the old run aside when asked)."""

import json
import os

import pytest

from ballast.trainer.run.checkpoints import CheckpointManager, ResumePoint
from ballast.trainer.config import load_config
from ballast.trainer.main import EXIT_BAD_INPUT, failure
from ballast.trainer.run.preflight import claim_run_dir, resume_point
from ballast.trainer.run.run_dir import RunDirError

from testkit.e2e import overrides


def _cfg(run_dir, *extra):
    task = {"model": "/m", "train": "/t.parquet", "val": "/v.parquet"}
    return load_config(overrides(task, str(run_dir), "trainer.resume_mode=auto", *extra))


def _writer(content):
    def save_workers(path):
        os.makedirs(os.path.join(path, "actor"))
        with open(os.path.join(path, "actor", "shard_0.distcp"), "w") as f:
            f.write(content * 100)
    return save_workers


def _finished_run(run_dir, checkpoints=()):
    """What a finished run leaves: its config, metrics of steps 1-3 and the checkpoints asked for."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump({"trainer": {"save_freq": -1}}, f)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": step, "critic/score/mean": 0.5}) + "\n" for step in (1, 2, 3))
    manager = CheckpointManager(str(run_dir))
    for step in checkpoints:
        manager.save(step, _writer(str(step)), {})
    return manager


def _contents(run_dir):
    return {name: open(os.path.join(run_dir, name)).read() for name in ("config.json", "metrics.jsonl")}


def test_each_resume_mode_resolves_to_one_typed_point(tmp_path):
    manager = _finished_run(str(tmp_path), checkpoints=(1, 2))
    t = _cfg(tmp_path).trainer
    assert resume_point(t) == ResumePoint(manager.step_dir(2), 2)
    assert resume_point(_cfg(tmp_path, "trainer.resume_mode=disable").trainer) == ResumePoint()
    assert resume_point(_cfg(tmp_path, "trainer.resume_mode=resume_path",
                             f"trainer.resume_from_path={manager.step_dir(1)}").trainer) == ResumePoint(manager.step_dir(1), 1)
    assert resume_point(_cfg(tmp_path, f"trainer.resume_mode={manager.step_dir(1)}").trainer).step == 1
    assert ResumePoint().fresh and not ResumePoint(manager.step_dir(1), 1).fresh


def test_claiming_the_run_directory_keeps_resume_mode_as_written(tmp_path):
    manager = _finished_run(str(tmp_path), checkpoints=(1, 2))
    cfg = _cfg(tmp_path)
    point, lock = claim_run_dir(cfg)
    lock.release()
    assert point == ResumePoint(manager.step_dir(2), 2) and cfg.trainer.resume_mode == "auto"


@pytest.mark.parametrize("checkpoints, damaged", [((), False), ((1, 2), True)],
                         ids=["no checkpoint (save_freq=-1)", "every checkpoint damaged"])
def test_auto_rerun_without_a_usable_checkpoint_is_refused_and_overwrites_nothing(tmp_path, checkpoints, damaged):
    run_dir = str(tmp_path / "run")
    manager = _finished_run(run_dir, checkpoints)
    for step in checkpoints if damaged else ():
        with open(os.path.join(manager.step_dir(step), "actor", "shard_0.distcp"), "r+") as f:
            f.truncate(10)
    before = _contents(run_dir)
    with pytest.raises(RunDirError, match=r"already holds a run \(.*metrics\.jsonl.*\) but no complete checkpoint to "
                                          r"continue it from, and trainer\.resume_mode='auto' would start a new one on "
                                          r"top of it; .*new trainer\.default_local_dir.*move_old_run_aside=true"
                       ) as info:
        claim_run_dir(_cfg(run_dir))
    assert failure(info.value)[0] == EXIT_BAD_INPUT
    assert _contents(run_dir) == before

    point, lock = claim_run_dir(_cfg(run_dir, "trainer.move_old_run_aside=true"))
    lock.release()
    moved = [name for name in os.listdir(tmp_path) if name.startswith("run.old-")]
    assert point.fresh and len(moved) == 1 and _contents(str(tmp_path / moved[0])) == before
    assert sorted(os.listdir(run_dir)) == [".ballast.lock"]


def test_auto_in_a_new_or_empty_directory_is_a_fresh_start(tmp_path):
    point, lock = claim_run_dir(_cfg(tmp_path / "new"))
    lock.release()
    assert point == ResumePoint()
