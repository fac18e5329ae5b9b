"""Run checkpoints: atomic step directories, latest pointer, retention, RNG state round trip."""

import os
import random

import numpy as np
import pytest
import torch

from ballast.trainer.run.checkpoints import CheckpointManager, rng_state, set_rng_state


def _writer(content):
    def save_workers(path):
        os.makedirs(os.path.join(path, "actor"))
        with open(os.path.join(path, "actor", "weights.bin"), "w") as f:
            f.write(content)
    return save_workers


def test_save_then_latest_and_state(tmp_path):
    mgr = CheckpointManager(str(tmp_path))
    assert mgr.latest() is None
    path = mgr.save(2, _writer("two"), {"dataloader": {"epoch": 0, "position": 32}})
    assert path.endswith("global_step_2") and mgr.latest() == path
    state = CheckpointManager.read_state(path)
    assert state["global_step"] == 2 and state["dataloader"]["position"] == 32
    assert open(os.path.join(path, "actor", "weights.bin")).read() == "two"


def test_crash_during_save_keeps_the_previous_checkpoint(tmp_path):
    mgr = CheckpointManager(str(tmp_path))
    good = mgr.save(2, _writer("two"), {"x": 1})

    def crashing(path):
        _writer("half")(path)
        raise RuntimeError("worker died while writing")

    with pytest.raises(RuntimeError, match="worker died"):
        mgr.save(4, crashing, {"x": 2})
    assert mgr.latest() == good
    assert not os.path.exists(mgr.step_dir(4))
    assert mgr.steps() == [2]
    assert CheckpointManager.read_state(good)["x"] == 1
    # the next successful save replaces the leftover temporary directory
    assert mgr.save(4, _writer("four"), {"x": 3}) == mgr.step_dir(4)
    assert mgr.latest() == mgr.step_dir(4)


def test_retention_keeps_the_newest(tmp_path):
    mgr = CheckpointManager(str(tmp_path), max_to_keep=2)
    for step in (1, 2, 3, 4):
        mgr.save(step, _writer(str(step)), {})
    assert mgr.steps() == [3, 4]
    with pytest.raises(ValueError, match="max_actor_ckpt_to_keep=0"):
        CheckpointManager(str(tmp_path), max_to_keep=0)


def test_read_state_of_a_non_checkpoint_names_the_path(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path)):
        CheckpointManager.read_state(str(tmp_path))


def test_rng_state_round_trip_through_json():
    import json

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    saved = json.loads(json.dumps(rng_state()))
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(saved)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected
