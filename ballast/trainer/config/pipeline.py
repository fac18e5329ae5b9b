"""A role's pipeline parallelism from verl's `megatron` keys, checked at start-up.

`<role>.megatron.pipeline_model_parallel_size` > 1 gives the role's engine a pipeline of that many
workers (`ballast.engine.pipeline`); the role's data-parallel size is then workers / (sp x pp).
The driver plans the role's micro-batches with the pipeline cost model made here from the model's
config (the same split into stages the engine makes), so the count, the slots and the order are
the schedule's. What a pipeline does not compose with is a `ConfigError` naming both keys;
the engine's own rules (LoRA, CPU offload, bf16, sharded stages) are named when its spec is built.
`resume_layout_refusal` refuses, before any worker starts, a checkpoint saved under other pipeline sizes.
"""

from __future__ import annotations

import os
from typing import Optional

from ballast.balance import FlopsModel, PipelineCostModel, PipelineShape
from ballast.trainer.config.loader import ConfigError
from ballast.trainer.config.model_info import ModelInfo


def flops_model(model: ModelInfo) -> FlopsModel:
    return FlopsModel(hidden_size=model.hidden_size, num_layers=model.num_hidden_layers,
                      num_heads=model.num_attention_heads, num_kv_heads=model.num_key_value_heads,
                      intermediate_size=model.intermediate_size, vocab_size=model.vocab_size, head_dim=model.head_dim)


def pipeline_shape(megatron, schedule) -> Optional[PipelineShape]:
    """The shape the keys ask for, or None without a pipeline (errors name no key: see role_pipeline)."""
    pp = megatron.pipeline_model_parallel_size
    v = megatron.virtual_pipeline_model_parallel_size
    if pp == 1:
        if v not in (None, 1):
            raise ValueError(f"virtual_pipeline_model_parallel_size={v} needs pipeline_model_parallel_size > 1")
        return None
    return PipelineShape(pp, 1 if v is None else v, str(schedule),
                         megatron.override_transformer_config.microbatch_group_size_per_vp_stage)


def role_pipeline(prefix: str, section, world: int, sp: int, model: Optional[ModelInfo], *, remove_padding_key: str,
                  remove_padding: bool, conflicts: dict) -> Optional[PipelineCostModel]:
    """The cost model of the role under `prefix` (whose config `section` has `megatron` and
    `pipeline_schedule`), or None without a pipeline. `conflicts`: {key: set} of settings that do
    not run through a pipeline."""
    pp_key = f"{prefix}.megatron.pipeline_model_parallel_size"
    pp = section.megatron.pipeline_model_parallel_size
    if pp < 1:
        raise ConfigError(f"{pp_key}={pp} must be >= 1")
    try:
        shape = pipeline_shape(section.megatron, section.pipeline_schedule)
    except ValueError as err:
        raise ConfigError(f"{prefix}.megatron / {prefix}.pipeline_schedule: {err}") from None
    if shape is None:
        return None
    if sp > 1:
        raise ConfigError(f"{pp_key}={pp} does not compose with Ulysses: {prefix}.ulysses_sequence_parallel_size={sp} "
                          "must be 1 (a pipeline stage holds whole packed sequences)")
    if world % pp:
        raise ConfigError(f"world size (trainer.nnodes * trainer.n_gpus_per_node)={world} is not divisible by "
                          f"{pp_key}={pp}")
    if not remove_padding:
        raise ConfigError(f"{pp_key}={pp} needs {remove_padding_key}=True (micro-batches travel as packed token slots)")
    for key, is_set in conflicts.items():
        if is_set:
            raise ConfigError(f"{pp_key}={pp} does not compose with {key}=True: set one of them off")
    if model is None:
        raise ConfigError(f"{pp_key}={pp} needs the model's config.json to split it into stages")
    if model.num_hidden_layers < shape.num_stages:
        raise ConfigError(f"{pp_key}={pp} x virtual_pipeline_model_parallel_size={shape.virtual_stages} = "
                          f"{shape.num_stages} stages, but the model has {model.num_hidden_layers} decoder layers "
                          "(a stage holds at least one)")
    return PipelineCostModel.from_flops(flops_model(model), shape)


def resume_layout_refusal(checkpoint: str, sizes) -> Optional[str]:
    """None when every role checkpoint under `checkpoint` (a step directory) was saved with the pipeline
    sizes this run's `sizes` (`DerivedSizes`) give its role, else the refusal naming the role's key. A
    role's optimizer state is its stages', so a resume keeps the sizes; the step's HF export (actor_hf)
    starts a new run under any. The engine checks the full layout (every stage's layers) again."""
    from ballast.engine.checkpoint import saved_pipeline_layout

    for role, prefix in (("actor", "actor_rollout_ref.actor"), ("critic", "critic")):
        role_dir, role_sizes = os.path.join(checkpoint, role), getattr(sizes, role)
        if role_sizes is None or not os.path.isdir(role_dir):
            continue
        saved = saved_pipeline_layout(role_dir) or {}
        shape = None if role_sizes.pipeline is None else role_sizes.pipeline.shape
        then = (saved.get("pipeline_model_parallel_size", 1), saved.get("virtual_pipeline_model_parallel_size", 1))
        now = (1, 1) if shape is None else (shape.pp_size, shape.virtual_stages)
        if then != now:
            return (f"checkpoint {role_dir!r} was saved with {prefix}.megatron.pipeline_model_parallel_size={then[0]} "
                    f"and virtual_pipeline_model_parallel_size={then[1]}, this run has {now[0]} and {now[1]}: a "
                    f"checkpoint resumes only under the pipeline sizes it was saved with (each rank's optimizer state "
                    f"is its stages'); set them back to resume, or start a new run from the step's HF export "
                    f"({os.path.join(checkpoint, 'actor_hf')}) with actor_rollout_ref.model.path (weights only)")
    return None
