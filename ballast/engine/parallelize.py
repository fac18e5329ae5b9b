"""The one place where parallelism is applied to a loaded model, always in this order:

1. Ulysses: attention is routed through `ballast.engine.attention` (which does the all-to-alls when a
   context with an SP group is passed) and the head counts are checked against sp;
2. activation checkpointing of every decoder layer (optional);
3. data parallelism (`ballast.engine.data_parallel`): FSDP2 `fully_shard` of every decoder layer,
   then of the root, over the parameter mesh, with bf16 compute / fp32 reduction on CUDA (fp32
   throughout on CPU) and optional CPU offload (CUDA only), or whole replicas (below);
4. gradient reduction switched from FSDP's default average over the mesh to a plain SUM;
5. on CPU, a tied input embedding's gradient made sparse (below).

Why 4: each rank's loss is its exact share of the mini-batch loss (`ballast.engine.losses`), and the
SP ranks' gradients of one replica add up to that replica's gradient (`ballast.engine.ulysses`); the
mini-batch gradient is therefore the sum over all dp x sp ranks. FSDP's default would divide it by
dp * sp. The divide factor must be set on every FSDP module (each reduces its own parameters), and
sum-only reductions are forced because gloo has no pre-multiplied sum.

Whole replicas (`fsdp_size=1`, or a single rank; fp32 compute, no offload: `choose_mode`) are
not FSDP2-wrapped: every rank holds the whole model, so FSDP2 would shard nothing, yet it would still
copy each layer's gradients into a flat buffer, divide them by the factor 1 into a new buffer and
copy that into a third before all-reducing it (three passes over the gradients per backward).
Instead the model stays a plain module and a trainable one is wrapped in `DistributedDataParallel`,
whose gradients are views into its all-reduce buckets (no copies) and whose bucket all-reduces start
during backward; its communication hook sums (step 4) instead of averaging. A frozen model (the
reference) needs no wrapper at all. With bf16 compute the FSDP2 path stays: DDP has no
parameter-cast policy.

Why 5: with tied embeddings (SmolLM2, Qwen2's small models) the vocabulary matrix gets two
gradients: the LM head's, a dense matmul, and the embedding lookup's, which torch computes densely
by zero-filling a fresh vocabulary-sized tensor, adding the few looked-up rows into it and then
adding that whole tensor to the head's. On a CPU those passes over the matrix (113 MB for
SmolLM2-135M) cost ~0.2-0.8 s of a ~8 s forward+backward. A sparse lookup gradient holds only the
rows looked up, and autograd adds it into the head's dense gradient before the parameter sees it, so
the parameter's gradient stays dense (same values up to the order of the float additions) and
optimizers, clipping and reductions are untouched. It is switched on after wrapping because DDP,
at construction, would put a parameter of a sparse embedding in a bucket that expects a sparse final
gradient. Untied or frozen embeddings keep the dense lookup: their gradient would be sparse itself.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from transformers import PreTrainedModel

from ballast.engine import attention
from ballast.engine.config import EngineConfig
from ballast.engine.data_parallel import DataParallel, DataParallelMode, choose_mode, defers_fsdp_reduction
from ballast.engine.dist import ParallelState, resolve_shard_size
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


def data_parallel_mode(cfg: EngineConfig, world_size: int, device_type: str) -> DataParallelMode:
    """The mode `parallelize` will give an engine configured by `cfg` on `world_size` ranks of
    `device_type` ('cpu' or 'cuda'); needs no model or process group (`choose_mode` on the config)."""
    return choose_mode(world_size, resolve_shard_size(cfg.fsdp_size, world_size), cfg.cpu_offload,
                       compute_dtype(cfg, device_type), cfg.trainable)


def _sum_allreduce_hook(group, bucket):
    """DDP communication hook: all-reduce a gradient bucket with SUM (DDP's own hooks average).

    Unannotated on purpose: DDP compares the annotations to its classes, and postponed evaluation
    (`from __future__ import annotations`) turns them into strings it rejects."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _no_forward_buffer_sync() -> dict:
    """DDP's keyword for "do not broadcast buffers before every forward". torch 2.13 renamed it
    (`broadcast_buffers` now warns at every construction); older releases know only the old name. The
    new one also broadcasts them once at construction, which changes nothing for equal buffers."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def _replicate(model: PreTrainedModel, parallel: ParallelState, mode: DataParallelMode) -> DataParallel:
    # The model is loaded on the host; FSDP2 would move it to the mesh's device, a replica moves itself.
    model.to(parallel.device)
    if mode is DataParallelMode.REPLICA:
        return DataParallel(model, mode, defer_reduction=False)
    group = parallel.replica_group
    ddp = DistributedDataParallel(
        model,
        process_group=group,
        # Buffers (rotary frequencies) are computed identically on every rank: no per-forward broadcast.
        **_no_forward_buffer_sync(),
        gradient_as_bucket_view=True,
    )
    ddp.register_comm_hook(group, _sum_allreduce_hook)
    # On every device: a replica's gradients are whole whether they are reduced once or every time.
    return DataParallel(ddp, mode, defer_reduction=True)


def parallelize(model: PreTrainedModel, parallel: ParallelState, cfg: EngineConfig) -> DataParallel:
    """Apply Ulysses routing, activation checkpointing and FSDP2 (or replication) to `model` in place.

    Returns the data-parallel strategy: its `module` is what training forwards must go through,
    `model` itself (FSDP2 turns it into an `FSDPModule` in place; a frozen replica) or a
    `DistributedDataParallel` wrapper around it.
    """
    # 1. Ulysses / packed attention routing
    attention.install(model)
    check_ulysses_compatible(model, parallel.sp_size)

    # 2. activation checkpointing (non-reentrant: composes with FSDP2 hooks and kwargs)
    if cfg.enable_activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    # 3. data parallelism
    if cfg.cpu_offload and parallel.device_type != "cuda":
        raise ValueError(
            "cpu_offload=True offloads parameters from a GPU to host memory; on a CPU-only engine "
            "(device='cpu') there is nothing to offload — set cpu_offload=False"
        )
    dtype = compute_dtype(cfg, parallel.device_type)
    mode = choose_mode(parallel.world_size, parallel.shard_size, cfg.cpu_offload, dtype, cfg.trainable)
    sparse_lookup = parallel.device_type == "cpu" and _has_trainable_tied_embedding(model)
    if mode is not DataParallelMode.FSDP:
        strategy = _replicate(model, parallel, mode)
    else:
        _fully_shard(model, parallel, cfg, dtype)
        strategy = DataParallel(model, mode, defer_reduction=defers_fsdp_reduction(parallel.device_type))

    # 5. tied embedding: sparse lookup gradient, summed into the head's dense one by autograd
    if sparse_lookup:
        model.get_input_embeddings().sparse = True
    return strategy


def _has_trainable_tied_embedding(model: PreTrainedModel) -> bool:
    """Whether the input embedding is a trainable `nn.Embedding` whose weight is also the LM head's."""
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    return (isinstance(inputs, torch.nn.Embedding) and outputs is not None
            and outputs.weight is inputs.weight and inputs.weight.requires_grad)


def _fully_shard(model: PreTrainedModel, parallel: ParallelState, cfg: EngineConfig, dtype: torch.dtype) -> None:
    """FSDP2 on every decoder layer, then the root, with the gradient reduction switched to SUM."""
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    shard_kwargs = dict(mesh=parallel.param_mesh, mp_policy=mp_policy)
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
