"""vLLM tensor parallelism across processes that each see a single GPU.

Ray gives every GPU actor its own `CUDA_VISIBLE_DEVICES` (one entry), and Ballast's rollout joins the
workers' torch.distributed world (`external_launcher`), so the TP peers of an engine are processes
that cannot see each other's devices. vLLM's all-reduce fast paths assume they can:

* the custom all-reduce checks peer-to-peer access for every TP peer by its local rank, mapping each
  through the device list (`device_id_to_physical_device_id` in vLLM's platforms/interface.py indexes
  `CUDA_VISIBLE_DEVICES` by the peer's rank): with one visible device the second peer is an
  IndexError inside engine construction (vLLM 0.33); its IPC buffers would need the peers' devices too;
* FlashInfer's all-reduce and its all-reduce + RMSNorm fusion (a compilation pass vLLM turns on by
  default for TP > 1 on Hopper/Blackwell with FlashInfer installed), and torch symmetric-memory
  all-reduce, map the peers' memory the same way (IPC handles or multicast over the peers' devices).

In that layout they are all switched off, and the TP all-reduce goes through NCCL, which works across
processes with one device each (it is what the trainer's own collectives use). Where a process sees
every GPU of its TP group (e.g. `RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES`), nothing changes.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

# Read by vLLM when its TP communicator is built (vllm.envs, not cached before the engine starts).
PEER_ALL_REDUCE_ENV = {"VLLM_ALLREDUCE_USE_FLASHINFER": "0", "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}


def visible_cuda_devices() -> int:
    """GPUs this process may use: the entries of CUDA_VISIBLE_DEVICES (an empty value counts as unset,
    as vLLM reads it), else every device torch sees."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if value.strip():
        return len([entry for entry in value.split(",") if entry.strip()])
    return torch.cuda.device_count()


def tp_peers_hidden(on_gpu: bool, distributed: bool, tp_size: int, visible: Optional[int] = None) -> bool:
    """True when the engine's TP peers are other processes whose GPUs this process cannot see."""
    if not (on_gpu and distributed and tp_size > 1):
        return False
    return (visible_cuda_devices() if visible is None else visible) < tp_size


def peer_all_reduce_kwargs(hidden: bool) -> dict:
    """`vllm.LLM` arguments that keep the TP all-reduce off peer-memory paths when peers are hidden."""
    if not hidden:
        return {}
    return {"disable_custom_all_reduce": True,
            "compilation_config": {"pass_config": {"fuse_allreduce_rms": False}}}


def peer_all_reduce_env(hidden: bool) -> dict:
    """Environment variables to set before the engine is built when peers are hidden."""
    return dict(PEER_ALL_REDUCE_ENV) if hidden else {}
