"""Start-up check of `actor_rollout_ref.rollout.gpu_memory_utilization` against the models' sizes.

vLLM (0.33) reads gpu_memory_utilization as the fraction of the device's TOTAL memory that must be
FREE when its engine starts, and raises otherwise; with `kv_cache_memory_bytes` unset the same
fraction must also hold vLLM's own weights plus a KV cache. In the colocated worker the engine
starts after the actor (and reference) engines are loaded on the same GPU, so their float32 FSDP
shards are already resident: verl-style values of 0.8-0.9 on a model that fills a good part of the
device cannot fit. This module turns that into a `ConfigError` on the driver, before any worker
starts, from the checkpoint's parameter count and the device's total memory.

The numbers are estimates of what is resident at engine start (optimizer state and gradients come
later, while vLLM sleeps); an allowance covers each process's CUDA context and NCCL buffers.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Optional

from ballast.trainer.config.derived import uses_reference
from ballast.trainer.config.loader import ConfigError
from ballast.trainer.config.schema import BallastConfig

GIB = 1 << 30
# CUDA context, cuBLAS workspaces and NCCL communicators of one worker process (an estimate).
CUDA_OVERHEAD_BYTES = GIB
FP32_BYTES = 4
VLLM_DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


@dataclass(frozen=True)
class RolloutMemoryPlan:
    """Bytes per GPU when the colocated vLLM engine starts, and what vLLM will ask for."""

    total_bytes: int
    actor_bytes: int
    ref_bytes: int
    overhead_bytes: int
    vllm_weight_bytes: int
    utilization: float

    @property
    def resident_bytes(self) -> int:
        return self.actor_bytes + self.ref_bytes + self.overhead_bytes

    @property
    def requested_bytes(self) -> int:
        return int(self.total_bytes * self.utilization)

    @property
    def max_utilization(self) -> float:
        """The largest value that fits, rounded down to 0.01 (it is printed as a suggestion)."""
        return math.floor(100 * (self.total_bytes - self.resident_bytes) / self.total_bytes) / 100


def checkpoint_param_count(model_dir: str) -> Optional[int]:
    """Number of parameters stored in a directory's *.safetensors files (headers only), or None."""
    files = sorted(Path(model_dir).expanduser().glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for path in files:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        total += sum(prod(entry["shape"]) for key, entry in header.items() if key != "__metadata__")
    return total


def gpu_total_bytes() -> Optional[int]:
    """The smallest total memory of the GPUs this machine shows (nvidia-smi, so no CUDA context is
    created in the driver process), or None when there is no NVIDIA GPU or the query fails."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        mib = [int(line) for line in out.split() if line.strip().isdigit()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return min(mib) * (1 << 20) if mib else None


def rollout_memory_plan(cfg: BallastConfig, param_count: int, total_bytes: int) -> RolloutMemoryPlan:
    arr = cfg.actor_rollout_ref
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    shard = FP32_BYTES * param_count // world  # FSDP2 float32 master weights over every rank
    actor_fsdp = arr.actor.fsdp_config
    actor_bytes = 0 if (actor_fsdp.param_offload or actor_fsdp.optimizer_offload) else shard
    ref_bytes = shard if uses_reference(cfg) and not arr.ref.fsdp_config.param_offload else 0
    weight_bytes = VLLM_DTYPE_BYTES.get(arr.rollout.dtype, 2) * param_count // arr.rollout.tensor_model_parallel_size
    return RolloutMemoryPlan(total_bytes=total_bytes, actor_bytes=actor_bytes, ref_bytes=ref_bytes,
                             overhead_bytes=CUDA_OVERHEAD_BYTES, vllm_weight_bytes=weight_bytes,
                             utilization=arr.rollout.gpu_memory_utilization)


def check_rollout_gpu_memory(cfg: BallastConfig, param_count: int, total_bytes: int) -> RolloutMemoryPlan:
    """Raise `ConfigError` when vLLM cannot start beside the actor/ref shards with this utilization."""
    plan = rollout_memory_plan(cfg, param_count, total_bytes)
    key = "actor_rollout_ref.rollout.gpu_memory_utilization"
    gib = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    if plan.requested_bytes > total_bytes - plan.resident_bytes:
        raise ConfigError(
            f"{key}={plan.utilization} asks vLLM for {plan.utilization} x {gib(total_bytes)} = "
            f"{gib(plan.requested_bytes)} of FREE memory per GPU when its engine starts, but by then the "
            f"actor ({gib(plan.actor_bytes)}) and reference ({gib(plan.ref_bytes)}) float32 FSDP shards of "
            f"{param_count / 1e9:.3g}B parameters over {cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node} GPU(s) "
            f"plus ~{gib(plan.overhead_bytes)} of CUDA/NCCL overhead hold {gib(plan.resident_bytes)}: use at "
            f"most {plan.max_utilization:.2f} (vLLM's value is a fraction of total memory, not of what is free)"
        )
    # With kv_cache_memory_bytes vLLM takes that size and skips the budget; without it the KV cache
    # is what remains of the requested memory after vLLM's own weights (and activations).
    if cfg.actor_rollout_ref.rollout.kv_cache_memory_bytes is None and plan.requested_bytes <= plan.vllm_weight_bytes:
        raise ConfigError(
            f"{key}={plan.utilization} gives vLLM {gib(plan.requested_bytes)} per GPU, less than its own weights "
            f"({gib(plan.vllm_weight_bytes)}), so no room for a KV cache: raise it (at most "
            f"{plan.max_utilization:.2f} fits beside the actor/ref shards) or set "
            "actor_rollout_ref.rollout.kv_cache_memory_bytes"
        )
    return plan


def check_rollout_gpu_memory_at_start(cfg: BallastConfig) -> Optional[RolloutMemoryPlan]:
    """`check_rollout_gpu_memory` for a vLLM run on CUDA, when this machine shows its GPUs (a driver
    without GPUs cannot know the devices' size: the check is skipped and vLLM's own error remains)."""
    if cfg.actor_rollout_ref.rollout.name != "vllm" or cfg.trainer.device == "cpu":
        return None
    total = gpu_total_bytes()
    params = checkpoint_param_count(cfg.actor_rollout_ref.model.path) if total else None
    if not total or not params:
        return None
    return check_rollout_gpu_memory(cfg, params, total)
