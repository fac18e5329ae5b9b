"""The one place where parallelism is applied to a loaded model, always in this order:

1. Ulysses: attention is routed through `ballast.engine.attention` (which does the all-to-alls when a
   context with an SP group is passed) and the head counts are checked against sp;
2. activation checkpointing of every decoder layer (optional);
3. FSDP2 `fully_shard` of every decoder layer, then of the root, over the flattened dp x sp mesh,
   with bf16 compute / fp32 reduction on CUDA (fp32 throughout on CPU) and optional CPU offload
   (CUDA only);
4. gradient reduction switched from FSDP's default average over the mesh to a plain SUM.

Why 4: each rank's loss is its exact share of the mini-batch loss (`ballast.engine.losses`), and the
SP ranks' gradients of one replica add up to that replica's gradient (`ballast.engine.ulysses`); the
mini-batch gradient is therefore the sum over all dp x sp ranks. FSDP's default would divide it by
dp * sp. The divide factor must be set on every FSDP module (each reduces its own parameters), and
sum-only reductions are forced because gloo has no pre-multiplied sum.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import PreTrainedModel

from ballast.engine import attention
from ballast.engine.config import EngineConfig
from ballast.engine.dist import ParallelState
from ballast.engine.model import decoder_layer_classes


def compute_dtype(cfg: EngineConfig, device_type: str) -> torch.dtype:
    """The dtype forward/backward run in: bf16 on CUDA by default, fp32 on CPU by default."""
    if cfg.precision == "bf16" or (cfg.precision == "auto" and device_type == "cuda"):
        return torch.bfloat16
    return torch.float32


def check_ulysses_compatible(model: PreTrainedModel, sp_size: int) -> None:
    if sp_size == 1:
        return
    num_heads = getattr(model.config, "num_attention_heads", None)
    if num_heads is None or num_heads % sp_size:
        raise ValueError(
            f"ulysses_sequence_parallel_size={sp_size} must divide num_attention_heads={num_heads}"
        )


def parallelize(model: PreTrainedModel, parallel: ParallelState, cfg: EngineConfig) -> PreTrainedModel:
    """Apply Ulysses routing, activation checkpointing and FSDP2 to `model` in place; returns it."""
    # 1. Ulysses / packed attention routing
    attention.install(model)
    check_ulysses_compatible(model, parallel.sp_size)

    # 2. activation checkpointing (non-reentrant: composes with FSDP2 hooks and kwargs)
    if cfg.enable_activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    # 3. FSDP2
    if cfg.cpu_offload and parallel.device_type != "cuda":
        raise ValueError(
            "cpu_offload=True offloads parameters from a GPU to host memory; on a CPU-only engine "
            "(device='cpu') there is nothing to offload — set cpu_offload=False"
        )
    dtype = compute_dtype(cfg, parallel.device_type)
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    shard_kwargs = dict(mesh=parallel.fsdp_mesh, mp_policy=mp_policy)
    if cfg.cpu_offload:
        shard_kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    layer_classes = decoder_layer_classes(model)
    for module in list(model.modules()):
        if isinstance(module, layer_classes):
            fully_shard(module, reshard_after_forward=cfg.reshard_after_forward, **shard_kwargs)
    # The root keeps embeddings, final norm and head; it is resharded after forward like the layers.
    fully_shard(model, reshard_after_forward=cfg.reshard_after_forward, **shard_kwargs)

    # 4. gradients: plain sum over the dp x sp mesh
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model
