"""The data-parallel mode rule and the lockstep rule, decided without a model or a process group."""

import json

import pytest
import torch

from ballast.engine import EngineConfig
from ballast.engine.data_parallel import DataParallelMode, choose_mode, micro_batch_lockstep
from ballast.engine.parallelize import data_parallel_mode

FSDP, DDP, REPLICA = DataParallelMode.FSDP, DataParallelMode.DDP, DataParallelMode.REPLICA


@pytest.mark.parametrize("world, shard, offload, dtype, trainable, expected", [
    (2, 1, False, torch.float32, True, DDP),        # whole fp32 replicas: DDP when trainable
    (8, 1, False, torch.float32, False, REPLICA),   # ... and a plain module when frozen
    (1, 1, False, torch.float32, True, DDP),        # one rank is a whole replica: FSDP2 would shard nothing
    (1, 1, False, torch.float32, False, REPLICA),
    (1, 1, False, torch.bfloat16, True, FSDP),      # ... except where replicas never apply
    (4, 4, False, torch.float32, True, FSDP),       # one copy sharded over every rank
    (4, 2, False, torch.float32, False, FSDP),      # hybrid sharding, frozen or not
    (4, 2, False, torch.float32, True, FSDP),
    (4, 1, False, torch.bfloat16, True, FSDP),      # bf16 compute: DDP has no parameter-cast policy
    (4, 1, False, torch.bfloat16, False, FSDP),
    (4, 1, True, torch.float32, True, FSDP),        # CPU offload is an FSDP2 policy
])
def test_choose_mode(world, shard, offload, dtype, trainable, expected):
    assert choose_mode(world, shard, offload, dtype, trainable) is expected


@pytest.mark.parametrize("role, fsdp_size, precision, world, device, expected", [
    ("actor", 1, "auto", 4, "cpu", DDP),            # the CPU default with fsdp_size=1
    ("critic", 1, "fp32", 2, "cuda", DDP),          # fp32 on CUDA replicates too
    ("ref", 1, "auto", 4, "cpu", REPLICA),
    ("actor", 1, "auto", 4, "cuda", FSDP),          # auto = bf16 on CUDA
    ("ref", 1, "bf16", 4, "cpu", FSDP),
    ("actor", -1, "auto", 4, "cpu", FSDP),
    ("actor", 16, "auto", 4, "cpu", FSDP),          # >= world means one copy over every rank
    ("actor", 2, "fp32", 4, "cpu", FSDP),
    ("actor", 1, "auto", 1, "cpu", DDP),            # one rank: whatever fsdp_size says
    ("actor", -1, "fp32", 1, "cpu", DDP),
    ("ref", -1, "auto", 1, "cpu", REPLICA),
    ("actor", -1, "auto", 1, "cuda", FSDP),         # bf16 on CUDA
])
def test_mode_from_the_engine_config_without_a_model(role, fsdp_size, precision, world, device, expected):
    cfg = EngineConfig(model_path="/unused", role=role, fsdp_size=fsdp_size, precision=precision, device="cpu")
    assert data_parallel_mode(cfg, world, device) is expected


def test_mode_from_config_rejects_a_shard_size_that_does_not_divide_the_world():
    with pytest.raises(ValueError, match="fsdp_size=3 must divide the world size 4"):
        data_parallel_mode(EngineConfig(model_path="/unused", fsdp_size=3, device="cpu"), 4, "cpu")


def test_lockstep_per_micro_batch():
    for device in ("cpu", "cuda"):
        for backward in (True, False):
            # replicas meet at most once per mini-batch (DDP's all-reduce in the last backward)
            assert not micro_batch_lockstep(DDP, device, True, backward)
            assert not micro_batch_lockstep(REPLICA, device, True, backward)
            # FSDP2 resharding after forward all-gathers again in every micro-batch
            assert micro_batch_lockstep(FSDP, device, True, backward)
            # parameters kept gathered: no all-gather after the first forward ...
            assert not micro_batch_lockstep(FSDP, device, False, backward=False)
    # ... so only a reduce-scatter per backward is left, and on CPU it waits for the last backward
    assert micro_batch_lockstep(FSDP, "cuda", False, backward=True)
    assert not micro_batch_lockstep(FSDP, "cpu", False, backward=True)


def test_mode_reads_as_its_name_in_reports():
    assert DDP == "ddp" and FSDP == "fsdp" and REPLICA == "replica"
    assert str(DDP) == "ddp" and f"{REPLICA}" == "replica"
    assert json.loads(json.dumps({"mode": FSDP})) == {"mode": "fsdp"}
    assert DataParallelMode("ddp") is DDP
