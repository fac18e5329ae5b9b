"""Checkpoint faults found on the driver before any worker loads: one rule for the marker file
(garbage, empty, missing, naming a missing step), checksums that catch a truncated shard with a
fall-back to the newest intact checkpoint, a full disk named as the cause with the partial directory
removed, and an early warning when the disk holds less than the last checkpoint's size."""

import errno
import re
import json
import os
import shutil
from collections import namedtuple
from types import SimpleNamespace

import pytest

from ballast.trainer.run import checkpoints as checkpointing
from ballast.trainer.run.checkpoints import CHECKSUMS, CheckpointError, CheckpointManager, choose_checkpoint
from ballast.trainer.main import EXIT_BAD_INPUT, failure
from ballast.trainer.run.preflight import resume_point


def _writer(content):
    def save_workers(path):
        os.makedirs(os.path.join(path, "actor"))
        with open(os.path.join(path, "actor", "shard_0.distcp"), "w") as f:
            f.write(content * 100)
    return save_workers


def _two_checkpoints(root):
    mgr = CheckpointManager(str(root))
    mgr.save(1, _writer("one"), {})
    mgr.save(2, _writer("two"), {})
    return mgr


def _trainer(run_dir, resume_mode, resume_from_path=None):
    """The `trainer` settings `resume_point` reads."""
    return SimpleNamespace(default_local_dir=str(run_dir), resume_mode=resume_mode, resume_from_path=resume_from_path)


def _marker(root, text):
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(text)


@pytest.mark.parametrize("marker, problem", [
    ("2", None),
    ("x7\n", r"holds 'x7', not a step number"),
    ("\u00b2", r"holds '\u00b2', not a step number"),  # str.isdigit() accepts a superscript two, int() does not
    ("\u0661", r"holds '\u0661', not a step number"),  # an Arabic-Indic one: int() reads it, Ballast never writes it
    ("", r"is empty"),
    (None, r"is missing"),
    ("9", r"names step 9, but .*global_step_9 does not exist"),
])
def test_one_rule_for_the_marker_file(tmp_path, marker, problem):
    mgr = _two_checkpoints(tmp_path)
    os.makedirs(tmp_path / "global_step_3")  # a half-written directory (no trainer_state.json) is never chosen
    if marker is None:
        os.remove(tmp_path / "latest_checkpointed_iteration.txt")
    else:
        _marker(tmp_path, marker)
    path, warnings = choose_checkpoint(str(tmp_path))
    assert path == mgr.step_dir(2) and mgr.latest() == path
    if problem is None:
        assert warnings == []
    else:
        assert len(warnings) >= 2, warnings
        assert "latest_checkpointed_iteration.txt" in warnings[0]
        assert re.search(problem, warnings[0]), warnings
        assert warnings[-1] == f"resuming from {mgr.step_dir(2)}, the newest complete checkpoint"


def test_new_directory_is_a_silent_fresh_start_and_a_bad_marker_alone_is_a_warned_one(tmp_path):
    assert choose_checkpoint(str(tmp_path / "nothing")) == (None, [])
    _marker(tmp_path, "garbage")
    path, warnings = choose_checkpoint(str(tmp_path))
    assert path is None and "not a step number" in warnings[0] and warnings[-1] == f"no complete checkpoint in {str(tmp_path)!r}"


def test_truncated_shard_of_the_newest_checkpoint_falls_back_to_the_intact_one(tmp_path, capsys):
    mgr = _two_checkpoints(tmp_path)
    shard = os.path.join(mgr.step_dir(2), "actor", "shard_0.distcp")
    manifest = json.load(open(os.path.join(mgr.step_dir(2), CHECKSUMS)))
    assert manifest["actor/shard_0.distcp"]["bytes"] == 300 and len(manifest["actor/shard_0.distcp"]["sha256"]) == 64
    with open(shard, "r+") as f:
        f.truncate(120)
    point = resume_point(_trainer(tmp_path, "auto"))
    assert point.checkpoint == mgr.step_dir(1) and point.step == 1
    err = capsys.readouterr().err
    assert f"{shard} has 120 bytes, 300 when saved (truncated or overwritten)" in err
    assert f"resuming from {mgr.step_dir(1)}, the newest complete checkpoint" in err

    # same size, different bytes: the digest catches it
    with open(os.path.join(mgr.step_dir(1), "actor", "shard_0.distcp"), "r+") as f:
        f.write("X")
    assert checkpointing.verify_checkpoint(mgr.step_dir(1)).endswith("does not match its SHA-256 from save time (damaged)")

    # asked for explicitly: an error naming the file and the intact one to use instead
    mgr.save(3, _writer("three"), {})
    with pytest.raises(CheckpointError, match=rf"cannot resume from '{mgr.step_dir(2)}': {shard} has 120 bytes.*"
                                              rf"newest intact checkpoint beside it is '{mgr.step_dir(3)}'") as info:
        resume_point(_trainer(tmp_path, "resume_path", mgr.step_dir(2)))
    code, line = failure(info.value)
    assert code == EXIT_BAD_INPUT and line.startswith("checkpoint: cannot resume from")


def test_disk_full_during_a_save_names_the_cause_and_removes_the_partial_directory(tmp_path):
    from ballast.single_controller import WorkerError

    mgr = CheckpointManager(str(tmp_path))
    good = mgr.save(1, _writer("one"), {})

    def full_disk(path):  # how a worker's ENOSPC reaches the driver: a remote traceback in a WorkerError
        _writer("half")(path)
        raise WorkerError("actor_rollout_ref.save_checkpoint: worker rank 0 raised\nTraceback ...\n"
                          f"OSError: [Errno 28] No space left on device while writing '{path}' (0 bytes free)")

    with pytest.raises(CheckpointError, match=rf"saving checkpoint global_step_2 into '{tmp_path}' failed: no space "
                                              r"left on device \(.* MiB free after writing 0\.0 MiB; the partial directory was removed\)"
                       ) as info:
        mgr.save(2, full_disk, {})
    assert sorted(os.listdir(tmp_path)) == ["global_step_1", "latest_checkpointed_iteration.txt"]
    assert mgr.latest() == good
    assert failure(info.value)[0] == EXIT_BAD_INPUT

    def other_error(path):  # not a full disk: the error passes through unchanged, the partial dir still goes
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        mgr.save(2, other_error, {})
    assert not os.path.exists(tmp_path / ".tmp_global_step_2")


def test_low_free_space_is_reported_before_a_save(tmp_path, monkeypatch, capsys):
    mgr = CheckpointManager(str(tmp_path))
    assert mgr.warn_if_low_on_space() is None  # nothing saved yet: nothing to compare with
    mgr.save(1, _writer("one"), {})
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 30, 10 << 30, 100))
    mgr.save(2, _writer("two"), {})
    err = capsys.readouterr().err
    assert f"ballast: warning: 0.0 MiB free in '{tmp_path}' but the last checkpoint (global_step_1) took" in err
    assert "the next save will likely fail" in err


def test_engine_save_turns_a_short_write_on_a_full_disk_into_enospc_naming_the_directory(tmp_path, monkeypatch):
    import torch

    from ballast.engine import checkpoint as engine_ckpt

    model = torch.nn.Linear(4, 4)
    optim = torch.optim.AdamW(model.parameters())

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(engine_ckpt.dcp, "save", no_space)
    with pytest.raises(OSError, match=rf"No space left on device while writing '{tmp_path}'") as info:
        engine_ckpt.save_checkpoint(str(tmp_path), model, optim, None, {"step": 1})
    assert info.value.errno == errno.ENOSPC and checkpointing.is_disk_full(info.value)

    # torch.save's zip writer says only "unexpected pos": the free space decides
    monkeypatch.setattr(engine_ckpt.dcp, "save", lambda *a, **k: None)
    monkeypatch.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("unexpected pos 704 vs 598")))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 30, 1 << 30, 4096))
    with pytest.raises(OSError, match=r"No space left on device .*\(4096 bytes free\): RuntimeError: unexpected pos"):
        engine_ckpt.save_checkpoint(str(tmp_path), model, optim, None, {"step": 1})
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 40, 0, 1 << 40))
    with pytest.raises(RuntimeError, match="^unexpected pos"):  # plenty of space: not called a full disk
        engine_ckpt.save_checkpoint(str(tmp_path), model, optim, None, {"step": 1})
