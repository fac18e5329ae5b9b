"""A save that cannot lie: whatever point a crash hits, no name (a `global_step_<k>` directory, the
marker file) claims a checkpoint that is not complete on disk, and `resume_mode=auto` takes the last
complete one. The kills are real SIGKILLs of a process in the middle of `CheckpointManager.save`, at
the points `BALLAST_KILL_AT` names (`ballast.trainer.run.fault_injection`)."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from ballast.trainer.run import checkpoints
from ballast.trainer.run.checkpoints import LATEST, CheckpointManager, choose_checkpoint, verify_checkpoint
from ballast.trainer.run.fault_injection import ENV, armed

SAVE_TWO_STEPS = """
import os, sys
from ballast.trainer.run.checkpoints import CheckpointManager

def writer(text):
    def write(path):
        os.makedirs(os.path.join(path, "actor"))
        with open(os.path.join(path, "actor", "weights.bin"), "w") as f:
            f.write(text * 1000)
    return write

manager = CheckpointManager(sys.argv[1])
for step in (1, 2):
    manager.save(step, writer(str(step)), {"dataloader": {"position": step}})
"""


def _writer(text):
    def write(path):
        os.makedirs(os.path.join(path, "actor"))
        with open(os.path.join(path, "actor", "weights.bin"), "w") as f:
            f.write(text)
    return write


@pytest.mark.parametrize("point, marker", [("saving", "1"), ("saved", "1")])
def test_a_process_killed_during_a_save_resumes_from_the_last_complete_checkpoint(tmp_path, point, marker):
    root = str(tmp_path / "run")
    env = {**os.environ, ENV: f"{point}@2"}
    proc = subprocess.run([sys.executable, "-c", SAVE_TWO_STEPS, root], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert re.search(rf"killing the driver \(pid \d+\) at {point}@2", proc.stderr), proc.stderr[-2000:]
    assert open(os.path.join(root, LATEST)).read() == marker  # the marker never ran ahead of the save
    chosen, warnings = choose_checkpoint(root)
    assert chosen == os.path.join(root, "global_step_1") and warnings == []
    assert CheckpointManager.read_state(chosen)["dataloader"] == {"position": 1}
    # whatever carries a checkpoint's name is complete: killed after the rename, step 2 is whole (its
    # marker not yet moved, so the previous one is still what the run continues from)
    for name in os.listdir(root):
        if name.startswith("global_step_"):
            assert verify_checkpoint(os.path.join(root, name)) is None, name
    assert os.path.isdir(os.path.join(root, "global_step_2")) == (point == "saved")
    # the resumed run saves step 2 again: over the leftover temporary directory, or over the complete
    # step-2 directory of the history it abandoned
    manager = CheckpointManager(root)
    assert manager.save(2, _writer("again"), {"dataloader": {"position": 2}}) == manager.step_dir(2)
    assert choose_checkpoint(root) == (manager.step_dir(2), [])
    assert sorted(os.listdir(root)) == ["global_step_1", "global_step_2", LATEST]


def test_every_file_is_on_disk_before_a_name_says_the_checkpoint_is_complete(tmp_path, monkeypatch):
    events = []
    fsync, rename, replace = os.fsync, os.rename, os.replace

    def recording_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "rename", lambda a, b: events.append(("rename", b)) or rename(a, b))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", b)) or replace(a, b))
    root = str(tmp_path / "run")
    final = CheckpointManager(root).save(3, _writer("w"), {"x": 1})
    renamed = events.index(("rename", final))
    tmp = os.path.join(root, ".tmp_global_step_3")
    # a file written aside and renamed (`<name>.tmp`, trainer_state.json and checksums.json) counts under its name
    flushed = {path.replace(tmp, final).removesuffix(".tmp") for kind, path in events[:renamed] if kind == "fsync"}
    on_disk = {os.path.join(base, name) for base, _, files in os.walk(final) for name in files}
    assert on_disk <= flushed, sorted(on_disk - flushed)  # every file, checksums.json included
    assert {os.path.join(final, "actor"), final} <= flushed  # and the directory entries
    marker = events.index(("replace", os.path.join(root, LATEST)))
    assert renamed < marker and ("fsync", root) in events[renamed:marker]  # the rename is on disk first
    assert events[-1] == ("fsync", root)  # and the marker's own rename


def test_a_crash_while_the_old_copy_of_a_step_is_deleted_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    # A step saved twice (the run resumed before it after a kill that left it complete): the old copy is
    # deleted first. A crash half-way through that deletion used to leave `global_step_2` without its
    # checksums.json but with its trainer_state.json: taken for a complete checkpoint of an older
    # version, and resumed from when the marker named nothing better.
    root = str(tmp_path / "run")
    manager = CheckpointManager(root)
    manager.save(1, _writer("1"), {})
    manager.save(2, _writer("2"), {})
    os.remove(os.path.join(root, LATEST))  # the marker names nothing: the newest complete one is used
    rmtree = shutil.rmtree

    def crash_half_way(path, ignore_errors=False):
        if os.path.isfile(os.path.join(path, checkpoints.CHECKSUMS)):
            os.remove(os.path.join(path, checkpoints.CHECKSUMS))
            raise OSError("killed while deleting")
        rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(shutil, "rmtree", crash_half_way)
    with pytest.raises(OSError, match="killed while deleting"):
        manager.save(2, _writer("2 again"), {})
    chosen, _ = choose_checkpoint(root)
    assert chosen == manager.step_dir(1) and not os.path.exists(manager.step_dir(2))


def test_a_save_after_resuming_earlier_removes_the_abandoned_later_steps_and_keeps_itself(tmp_path):
    # max_actor_ckpt_to_keep=1 used to keep the newest directory, step 4 of the abandoned history, and
    # delete step 3 just saved: the marker then named a missing checkpoint
    root = str(tmp_path / "run")
    manager = CheckpointManager(root, max_to_keep=1)
    for step in (1, 2, 4):
        manager.save(step, _writer(str(step)), {})
    manager.save(3, _writer("3"), {})
    assert manager.steps() == [3] and choose_checkpoint(root) == (manager.step_dir(3), [])
    assert json.load(open(os.path.join(manager.step_dir(3), "trainer_state.json")))["global_step"] == 3


def test_a_kill_point_naming_nothing_is_refused_naming_the_variable():
    assert armed({}) is None and armed({ENV: "saving@3"}) == ("saving", 3)
    for bad in ("saving", "saving@0", "halfway@2", "saving@two"):
        with pytest.raises(ValueError, match=f"{ENV}='{bad}' must be <point>@<step>.*'generating', 'saved'"):
            armed({ENV: bad})
