"""Schema of the sections the actor, reference and critic share: model, optimizer and FSDP settings,
and the choices they share (training backend, loss aggregation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional

from ballast.trainer.config.schema.choice import choice

# verl's values; `fsdp` (verl's FSDP1 wrapper) is a start-up error asking for `fsdp2`.
Strategy = choice("Strategy", __name__, "fsdp", "fsdp2")
# The engine's aggregations (`ballast.engine.losses.LOSS_AGG_MODES`; a test keeps the two equal).
LossAggMode = choice("LossAggMode", __name__, "token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                     "seq-mean-token-sum-norm")
# The pipeline engine's schedules (`ballast.balance.pipeline.SCHEDULE_KINDS`; a test keeps the two equal).
PipelineSchedule = choice("PipelineSchedule", __name__, "1f1b", "interleaved_1f1b", "zero_bubble")


@dataclass(frozen=True)
class TransformerOverrides:
    """The one field of verl's `megatron.override_transformer_config` that Ballast reads."""

    microbatch_group_size_per_vp_stage: Optional[int]
    """Micro-batches a virtual pipeline stage runs in a row (Megatron's); with virtual stages the
    micro-batch count is a multiple of it. null: `pipeline_model_parallel_size`, the only value
    torch.distributed.pipelining's interleaved schedules run (any other is a start-up error)."""


@dataclass(frozen=True)
class MegatronSection:
    """verl's `megatron` sizes of a role. Ballast runs them with its own pipeline engine
    (torch.distributed.pipelining, docs/pipeline.md), not Megatron-LM; only the pipeline sizes are read."""

    pipeline_model_parallel_size: int
    """Pipeline ranks the model is cut across (1: no pipeline); data-parallel size = workers / this."""
    virtual_pipeline_model_parallel_size: Optional[int]
    """Stages per pipeline rank (interleaved and zero-bubble schedules); null: 1."""
    override_transformer_config: TransformerOverrides
    """Megatron transformer settings; only `microbatch_group_size_per_vp_stage` is read."""


@dataclass(frozen=True)
class LoraSection:
    merge: bool
    """Sync the adapter merged into the weights (a full-weight sync) instead of the adapter alone; the
    adapter-only sync falls back to this by itself where the rollout cannot serve the adapter."""


@dataclass(frozen=True)
class ModelConfig:
    path: str
    """Hugging Face model directory."""
    tokenizer_path: Optional[str]
    """Tokenizer directory; null: the model directory."""
    use_remove_padding: bool
    """Pack the real tokens of a micro-batch into one sequence (required for Ulysses SP > 1)."""
    enable_gradient_checkpointing: bool
    """Recompute activations in the backward pass to save memory."""
    trust_remote_code: bool
    """Let transformers run model code shipped in the model directory."""
    lora_rank: int
    """LoRA rank; > 0 trains a LoRA adapter (PEFT) instead of the full weights; 0: full fine-tuning."""
    lora_alpha: float
    """LoRA scaling: the adapter's update is multiplied by `lora_alpha / lora_rank`."""
    target_modules: Any
    """Modules that get an adapter: `all-linear` (every linear layer but the output head), a list of
    module names (`[q_proj, v_proj]`), or one regular expression over module paths."""
    exclude_modules: Any
    """Modules never adapted (a list of names or a regular expression); null: none."""
    lora_adapter_path: Optional[str]
    """A PEFT adapter directory to continue training from (its own rank, alpha and targets apply);
    also turns LoRA on with `lora_rank: 0`."""
    lora: LoraSection
    """How the actor's adapter reaches the rollout."""


@dataclass(frozen=True)
class OptimSection:
    """AdamW and its learning-rate schedule (a section of the config; the engine's resolved form is
    `ballast.engine.OptimConfig`)."""

    lr: float
    """Peak learning rate (> 0)."""
    betas: List[float]
    """AdamW's two betas, each in [0, 1)."""
    weight_decay: float
    """AdamW's decoupled weight decay (>= 0)."""
    lr_warmup_steps: int
    """Linear warmup steps; <= 0 uses `lr_warmup_steps_ratio` of the total instead."""
    lr_warmup_steps_ratio: float
    """Warmup as a fraction of the total steps, in [0, 1], when `lr_warmup_steps <= 0`."""
    lr_scheduler_type: str
    """After warmup: `constant`, or `cosine` decay to `min_lr_ratio * lr` at the last step."""
    warmup_style: Optional[str]
    """verl's deprecated spelling of `lr_scheduler_type`; when set it overrides it."""
    min_lr_ratio: float
    """Floor of the cosine decay as a fraction of `lr`, in [0, 1]."""
    total_training_steps: int
    """Steps the schedule spans; -1: the trainer's step count."""


@dataclass(frozen=True)
class MixedPrecisionSection:
    """verl's `fsdp_config.mixed_precision`: the dtypes FSDP2 computes, reduces gradients and keeps buffers
    in. Master weights and optimizer states stay fp32 whatever is set here."""

    param_dtype: Optional[str]
    """Compute dtype of forward and backward: `bf16` or `fp32` (verl's spellings `bfloat16`, `float32`
    too); null: bf16 on CUDA, fp32 on CPU."""
    reduce_dtype: Optional[str]
    """Dtype gradients are reduced in: `fp32` (the only one; null means it)."""
    buffer_dtype: Optional[str]
    """Dtype of the model's buffers: `fp32` (the only one; null means it)."""


@dataclass(frozen=True)
class FSDPConfig:
    """A role's FSDP2 sharding and offload: `actor_rollout_ref.actor.fsdp_config`, `critic.fsdp_config`,
    and two placements whose unset (null) fields inherit: `actor_rollout_ref.ref.fsdp_config` from the
    actor's, `critic.model.fsdp_config` (verl's older spelling) from `critic.fsdp_config`.
    `ballast.trainer.config.fsdp` resolves and checks them."""

    param_offload: Optional[bool]
    """verl: parameters in host memory between phases. Not implemented for the actor and critic (true is a
    start-up error); for the optimizer-less reference model, FSDP2 CPU offload (CUDA only)."""
    optimizer_offload: Optional[bool]
    """verl: optimizer states in host memory between updates. Not implemented: true is a start-up error."""
    offload_policy: Optional[bool]
    """FSDP2 CPU offload of parameters, gradients and optimizer states (CUDA only)."""
    reshard_after_forward: Optional[bool]
    """Free the gathered parameters after each forward (FSDP2's `reshard_after_forward`)."""
    fsdp_size: Optional[int]
    """Workers that share one sharded copy of the model: -1 (or >= the worker count) shards over every
    worker; k (dividing the worker count) is hybrid sharding, workers / k replicas of a k-way shard with
    gradients summed across them; 1 keeps a whole replica on every worker (no parameter all-gathers and a
    local weight sync, for models small next to the worker's memory). The reference model shares the
    actor's device mesh, so its own value can only repeat the actor's."""
    mixed_precision: Optional[MixedPrecisionSection]
    """Compute precision (verl's key). null: the device's default (bf16 compute on CUDA, fp32 on CPU);
    in the reference's and `critic.model`'s sections, the section they inherit from."""
