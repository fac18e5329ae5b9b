"""A GPU worker's LOCAL_RANK is its CUDA device ordinal, not its slot on the node.

Simulated without a GPU: Ray's per-actor CUDA_VISIBLE_DEVICES and `ray.get_gpu_ids()` are faked, and
the CUDA calls of `init_distributed` are replaced by recorders over a process that sees one device.
"""

import os

import pytest
import ray
import torch
import torch.distributed as dist

from ballast.engine import dist as engine_dist
from ballast.single_controller.worker import Worker, visible_device_index


@pytest.mark.parametrize("assigned, visible, expected", [
    (["1"], "1", 0),            # Ray's default: the actor sees only its own GPU
    ([3], "3", 0),              # ids may come back as ints
    (["5"], "4,5,6", 1),        # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES with a restricted raylet
    (["2"], None, 2),           # ... with the variable unset: the id is the ordinal
    (["GPU-ab12"], "GPU-cd34,GPU-ab12", 1),  # UUIDs
])
def test_visible_device_index_maps_rays_gpu_into_the_visible_set(assigned, visible, expected):
    assert visible_device_index(assigned, visible) == expected


@pytest.mark.parametrize("assigned, visible, match", [
    ([], "0", "no GPU assigned"),
    (["3"], "0,1", "not in CUDA_VISIBLE_DEVICES"),
    (["GPU-ab12"], "", "cannot map"),
])
def test_visible_device_index_rejects_what_it_cannot_map(assigned, visible, match):
    with pytest.raises(ValueError, match=match):
        visible_device_index(assigned, visible)


@pytest.fixture
def fake_cuda_process(monkeypatch):
    """Rank 1 of a 2-GPU node as Ray starts it: the group's env plus Ray's one-GPU visibility."""
    for key, value in dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", BALLAST_NODE_LOCAL_RANK="1",
                           CUDA_VISIBLE_DEVICES="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: ["1"])
    calls = {"set_device": [], "init_process_group": []}

    def set_device(ordinal):
        if not 0 <= int(ordinal) < torch.cuda.device_count():
            raise RuntimeError("CUDA error: invalid device ordinal")
        calls["set_device"].append(int(ordinal))

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls["init_process_group"].append(kw))
    return calls


def test_gpu_worker_on_slot_one_uses_device_zero(fake_cuda_process):
    worker = Worker()
    assert worker.node_local_rank == 1
    assert worker.local_rank == 0
    assert os.environ["LOCAL_RANK"] == "0"  # what vLLM's external_launcher reads as cuda:<LOCAL_RANK>
    engine_dist.init_distributed("cuda")
    assert fake_cuda_process["set_device"] == [0]
    assert fake_cuda_process["init_process_group"][0]["backend"] == "cuda:nccl,cpu:gloo"


def test_init_distributed_names_local_rank_when_it_is_not_a_visible_device(fake_cuda_process, monkeypatch):
    # A launcher that hands over the node slot (the bug this guards against) fails with the cause, not
    # CUDA's bare "invalid device ordinal".
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ValueError, match=r"LOCAL_RANK=1 .* sees 1 CUDA device\(s\).*CUDA_VISIBLE_DEVICES='1'"):
        engine_dist.init_distributed("cuda")
    assert fake_cuda_process["set_device"] == []


def test_cpu_worker_keeps_the_node_slot_as_local_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("BALLAST_NODE_LOCAL_RANK", "1")
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])
    worker = Worker()
    assert worker.local_rank == 1 and worker.node_local_rank == 1
