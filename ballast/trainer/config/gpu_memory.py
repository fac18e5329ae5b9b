"""Start-up check of `actor_rollout_ref.rollout.gpu_memory_utilization` against the models' sizes.

vLLM (0.33) reads gpu_memory_utilization as the fraction of the device's TOTAL memory that must be
FREE when its engine starts, and raises otherwise; with `kv_cache_memory_bytes` unset the same
fraction must also hold vLLM's own weights plus a KV cache. In the colocated worker the engine
starts after the actor (and reference) engines are loaded on the same GPU, so their float32
parameter shards are already resident: verl-style values of 0.8-0.9 on a model that fills a good part
of the device cannot fit. A PPO critic is a second worker process on the same GPUs; it loads after the
engine has started, but its parameters stay resident while the engine takes its memory back on every
wake-up (sleep mode) and generates, so they count too, with a second process's CUDA context. This
module turns that into a `ConfigError` on the driver, before any worker starts, from the checkpoint's
parameter count and the device's total memory.

A rank holds 1/fsdp_size of a model's parameters (`fsdp_size=-1`: 1/world; `fsdp_size=1`: all of
them); the reference model shares the actor's mesh; a model under FSDP2 CPU offload (`offload_policy`,
for the reference also `param_offload`) holds none on the GPU. The critic's value model is counted
with the actor checkpoint's parameters unless `critic.model.path` names another checkpoint (its value
head is smaller than the LM head it replaces, so this errs on the safe side).

The engine's start is not the tightest moment: every later wake-up takes vLLM's memory back, and by
the second rollout the first update has left AdamW's state resident, two float32 moments per
trainable parameter, sharded like the parameters (the actor's and the critic's; the reference has no
optimizer). So a rank holds 12 bytes per trainable parameter of its shard: FSDP2 keeps the shards in
float32 whatever the compute precision (the bf16 copies live only while a layer runs), plus the two
moments. Gradients are not counted: every optimizer step frees them (`zero_grad(set_to_none=True)`)
before the next rollout. Under LoRA only the adapter is trainable: its parameters are counted from an
adapter loaded from disk, else bounded by `lora_rank x (rows + cols)` of every matrix in the checkpoint.
An allowance covers each process's CUDA context and NCCL buffers.
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

from ballast.engine.dist import resolve_shard_size
from ballast.trainer.config.derived import actor_uses_lora, uses_critic, uses_reference
from ballast.trainer.config.loader import ConfigError
from ballast.trainer.config.off_policy import split_pools
from ballast.trainer.config.schema import BallastConfig

GIB = 1 << 30
# CUDA context, cuBLAS workspaces and NCCL communicators of one worker process (an estimate).
CUDA_OVERHEAD_BYTES = GIB
FP32_BYTES = 4
ADAMW_MOMENTS = 2  # exp_avg and exp_avg_sq, each in the parameters' dtype (float32)
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
    critic_bytes: int = 0
    optimizer_bytes: int = 0  # AdamW's moments of the actor and the critic, resident from the first update on

    @property
    def resident_bytes(self) -> int:
        return self.actor_bytes + self.ref_bytes + self.critic_bytes + self.optimizer_bytes + self.overhead_bytes

    @property
    def requested_bytes(self) -> int:
        return int(self.total_bytes * self.utilization)

    @property
    def max_utilization(self) -> float:
        """The largest value that fits, rounded down to 0.01 (it is printed as a suggestion)."""
        return math.floor(100 * (self.total_bytes - self.resident_bytes) / self.total_bytes) / 100


def checkpoint_shapes(model_dir: str) -> Optional[list]:
    """The shapes of the tensors in a directory's *.safetensors files (headers only), or None."""
    files = sorted(Path(model_dir).expanduser().glob("*.safetensors"))
    if not files:
        return None
    shapes = []
    for path in files:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        shapes += [entry["shape"] for key, entry in header.items() if key != "__metadata__"]
    return shapes


def checkpoint_param_count(model_dir: str) -> Optional[int]:
    """Number of parameters stored in a directory's *.safetensors files (headers only), or None."""
    shapes = checkpoint_shapes(model_dir)
    return None if shapes is None else sum(prod(shape) for shape in shapes)


def lora_param_bound(shapes: list, rank: int) -> int:
    """At most how many parameters a rank-`rank` adapter of a model with these tensor shapes has:
    `rank x (rows + cols)` for every matrix, as if every one were adapted."""
    return sum(rank * (shape[0] + shape[1]) for shape in shapes if len(shape) == 2)


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


def rollout_memory_plan(cfg: BallastConfig, param_count: int, total_bytes: int,
                        critic_param_count: Optional[int] = None, adapter_param_count: int = 0) -> RolloutMemoryPlan:
    """What each GPU holds beside the colocated vLLM engine (see the module docstring);
    `adapter_param_count`: the actor's trainable parameters under LoRA."""
    arr = cfg.actor_rollout_ref
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node

    def shard(params: int, fsdp_size: int) -> int:  # float32 parameters held by one rank
        return FP32_BYTES * params // resolve_shard_size(fsdp_size, world)

    actor_fsdp, ref_fsdp, critic = arr.actor.fsdp_config, arr.ref.fsdp_config, cfg.critic
    actor_bytes = 0 if actor_fsdp.offload_policy else shard(param_count, actor_fsdp.fsdp_size)
    trainable = adapter_param_count if actor_uses_lora(cfg) else param_count
    # FSDP2 CPU offload keeps the optimizer state in host memory with the parameters
    optimizer_bytes = 0 if actor_fsdp.offload_policy else ADAMW_MOMENTS * shard(trainable, actor_fsdp.fsdp_size)
    ref_offloaded = ref_fsdp.offload_policy or ref_fsdp.param_offload
    # With LoRA the reference is the actor's own engine (adapter switched off): no second copy.
    separate_ref = uses_reference(cfg) and not actor_uses_lora(cfg) and not ref_offloaded
    ref_bytes = shard(param_count, actor_fsdp.fsdp_size) if separate_ref else 0
    critic_bytes, processes = 0, 1
    if uses_critic(cfg):
        processes = 2  # the critic worker: a second process (CUDA context, NCCL buffers) on every GPU
        if not (critic.fsdp_config.offload_policy or critic.model.fsdp_config.offload_policy):
            critic_bytes = shard(critic_param_count or param_count, critic.fsdp_config.fsdp_size)
            optimizer_bytes += ADAMW_MOMENTS * critic_bytes
    weight_bytes = VLLM_DTYPE_BYTES.get(arr.rollout.dtype, 2) * param_count // arr.rollout.tensor_model_parallel_size
    return RolloutMemoryPlan(total_bytes=total_bytes, actor_bytes=actor_bytes, ref_bytes=ref_bytes,
                             critic_bytes=critic_bytes, optimizer_bytes=optimizer_bytes,
                             overhead_bytes=processes * CUDA_OVERHEAD_BYTES, vllm_weight_bytes=weight_bytes,
                             utilization=arr.rollout.gpu_memory_utilization)


def check_rollout_gpu_memory(cfg: BallastConfig, param_count: int, total_bytes: int,
                             critic_param_count: Optional[int] = None, adapter_param_count: int = 0) -> RolloutMemoryPlan:
    """Raise `ConfigError` when vLLM cannot run beside the actor/ref/critic shards and their optimizer
    state with this utilization."""
    plan = rollout_memory_plan(cfg, param_count, total_bytes, critic_param_count, adapter_param_count)
    key = "actor_rollout_ref.rollout.gpu_memory_utilization"
    gib = lambda b: f"{b / GIB:.2f} GiB"  # noqa: E731
    if plan.requested_bytes > total_bytes - plan.resident_bytes:
        fsdp = cfg.actor_rollout_ref.actor.fsdp_config.fsdp_size
        critic = f", critic ({gib(plan.critic_bytes)})" if uses_critic(cfg) else ""
        fix = (f"use at most {plan.max_utilization:.2f}" if plan.max_utilization > 0 else
               "no value fits: shard the models over more GPUs (fsdp_size, trainer.n_gpus_per_node), offload them "
               "(fsdp_config.offload_policy=true) or train a LoRA adapter")
        raise ConfigError(
            f"{key}={plan.utilization} asks vLLM for {plan.utilization} x {gib(total_bytes)} = "
            f"{gib(plan.requested_bytes)} of FREE memory per GPU, but beside it the float32 parameter shards "
            f"of the actor ({gib(plan.actor_bytes)}), reference ({gib(plan.ref_bytes)}){critic} "
            f"({param_count / 1e9:.3g}B parameters; actor fsdp_size={fsdp} over "
            f"{cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node} GPU(s)), AdamW's two float32 moments per "
            f"trainable parameter ({gib(plan.optimizer_bytes)}, resident from the first update on, when every "
            f"rollout wakes vLLM) plus ~{gib(plan.overhead_bytes)} of CUDA/NCCL overhead hold "
            f"{gib(plan.resident_bytes)}: {fix} (vLLM's value is a fraction of total memory, not of what is free)"
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
    if split_pools(cfg):  # vLLM has devices of its own: nothing shares them
        return None
    total = gpu_total_bytes()
    model = cfg.actor_rollout_ref.model
    shapes = checkpoint_shapes(model.path) if total else None
    if not total or not shapes:
        return None
    params = sum(prod(shape) for shape in shapes)
    critic_params = None
    if uses_critic(cfg) and cfg.critic.model.path != model.path:
        critic_params = checkpoint_param_count(cfg.critic.model.path)
    adapter_params = 0
    if actor_uses_lora(cfg):
        saved = checkpoint_param_count(model.lora_adapter_path) if model.lora_adapter_path else None
        adapter_params = saved if saved is not None else lora_param_bound(shapes, model.lora_rank)
    return check_rollout_gpu_memory(cfg, params, total, critic_params, adapter_params)
