"""A tampered checkpoint cannot run code on resume. A real checkpoint (engine state through
torch.distributed.checkpoint, the driver's state, rollouts generated ahead) gets a pickle payload that
would write a marker file when unpickled, in each place a pickle could hide, and its checksums are
rewritten to match: the driver's start-up check refuses it naming the file and the config key, the
engine's own load refuses it naming the file or item, and the marker is never written."""

import io
import json
import os
import pickle
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ballast.engine.checkpoint import load_checkpoint, save_checkpoint
from ballast.engine.safe_load import RefusedFileError, read_dcp_metadata
from ballast.protocol import Batch
from ballast.trainer.main import EXIT_BAD_INPUT, failure
from ballast.trainer.run.checkpoints import CHECKSUMS, CheckpointError, CheckpointManager, file_checksums
from ballast.trainer.run.preflight import resume_point
from ballast.trainer.step.rollout_pipeline import Ahead, Rollout, load_rollouts_ahead, save_rollouts_ahead


class _Payload:
    """Unpickling this runs `exec`: it writes `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('ran')",)


def _engine():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


@pytest.fixture()
def checkpoint(tmp_path):
    model, optimizer, scheduler = _engine()
    batch = Batch({"input_ids": torch.ones(2, 3, dtype=torch.long)}, {"uid": np.array(["u-0", "u-1"], dtype=object)})

    def save_workers(path):
        save_checkpoint(os.path.join(path, "actor"), model, optimizer, scheduler, {"step": 1})
        save_rollouts_ahead(path, Ahead([Rollout(2, 1, batch, {"gen": 1.0}, {})]))

    run_dir = tmp_path / "run"
    return CheckpointManager(str(run_dir)).save(1, save_workers, {"dataloader": {}})


def _rehash(path):
    """What a tamperer does next: checksums that match the rewritten files."""
    with open(os.path.join(path, CHECKSUMS), "w") as f:
        json.dump({k: v for k, v in file_checksums(path).items() if k != CHECKSUMS}, f)


def _plant_in_dcp_item(dcp_dir, payload):
    """Replace the bytes of one non-tensor item of the shard with `payload`, fixing the metadata's offsets."""
    metadata = read_dcp_metadata(os.path.join(dcp_dir, ".metadata"))
    index = next(i for i in metadata.storage_data if i.fqn == "optim.param_groups.0.lr")
    info = metadata.storage_data[index]
    shard = os.path.join(dcp_dir, info.relative_path)
    with open(shard, "ab") as f:
        offset = f.tell()
        f.write(payload)
    metadata.storage_data[index] = type(info)(info.relative_path, offset, len(payload), info.transform_descriptors)
    with open(os.path.join(dcp_dir, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)


def _torch_bytes(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_an_untampered_checkpoint_resumes(checkpoint):
    point = resume_point(SimpleNamespace(default_local_dir=os.path.dirname(checkpoint), resume_mode="auto"))
    assert point.checkpoint == checkpoint and point.step == 1
    model, optimizer, scheduler = _engine()
    assert load_checkpoint(os.path.join(checkpoint, "actor"), model, optimizer, scheduler) == {"step": 1}
    (rollout,) = load_rollouts_ahead(checkpoint).rollouts
    assert rollout.step == 2 and list(rollout.batch["uid"]) == ["u-0", "u-1"]


@pytest.mark.parametrize("where", ["rollouts_ahead.pkl", "engine_state.pt", "dcp metadata"])
def test_a_pickle_payload_with_matching_checksums_is_refused_at_start_up_and_runs_nothing(checkpoint, tmp_path,
                                                                                          where):
    marker = tmp_path / "payload_ran"
    payload = pickle.dumps(_Payload(str(marker)))
    actor = os.path.join(checkpoint, "actor")
    target = {"rollouts_ahead.pkl": os.path.join(checkpoint, "rollouts_ahead.pkl"),
              "engine_state.pt": os.path.join(actor, "engine_state.pt"),
              "dcp metadata": os.path.join(actor, "dcp", ".metadata")}[where]
    if where == "engine_state.pt":
        payload = _torch_bytes(_Payload(str(marker)))
    with open(target, "wb") as f:
        f.write(payload)
    _rehash(checkpoint)

    for settings, key in ((SimpleNamespace(default_local_dir=os.path.dirname(checkpoint), resume_mode="auto"),
                           "trainer.resume_mode=auto"),
                          (SimpleNamespace(default_local_dir=str(tmp_path), resume_mode="resume_path",
                                           resume_from_path=checkpoint), "trainer.resume_from_path")):
        with pytest.raises(CheckpointError) as info:
            resume_point(settings)
        code, line = failure(info.value)
        assert code == EXIT_BAD_INPUT and key in line and target in line and "refused" in line, line
    # the loaders the workers and the driver's resume use refuse it too
    if where == "rollouts_ahead.pkl":
        with pytest.raises(CheckpointError, match="rollouts_ahead.pkl: refused: a pickle"):
            load_rollouts_ahead(checkpoint)
    else:
        model, optimizer, scheduler = _engine()
        with pytest.raises(RefusedFileError, match=f"{target}: refused"):
            load_checkpoint(actor, model, optimizer, scheduler)
    assert not marker.exists(), "the payload ran"


def test_a_payload_inside_a_dcp_shard_is_refused_by_the_engine_and_runs_nothing(checkpoint, tmp_path):
    marker = tmp_path / "payload_ran"
    dcp_dir = os.path.join(checkpoint, "actor", "dcp")
    _plant_in_dcp_item(dcp_dir, _torch_bytes(_Payload(str(marker))))
    _rehash(checkpoint)
    model, optimizer, scheduler = _engine()
    with pytest.raises(RefusedFileError, match=r"dcp: item 'optim\.param_groups\.0\.lr' refused by "
                                               r"torch\.load\(weights_only=True\)"):
        load_checkpoint(os.path.join(checkpoint, "actor"), model, optimizer, scheduler)
    assert not marker.exists(), "the payload ran"


def test_a_checkpoint_moved_whole_keeps_loading(checkpoint, tmp_path):
    moved = shutil.copytree(os.path.dirname(checkpoint), tmp_path / "moved")
    model, optimizer, scheduler = _engine()
    assert load_checkpoint(os.path.join(moved, "global_step_1", "actor"), model, optimizer, scheduler) == {"step": 1}
