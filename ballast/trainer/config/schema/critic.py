"""Schema of the `critic` section: the value model of GAE runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ballast.trainer.config.schema.model import (FSDPConfig, LossAggMode, MegatronSection, ModelConfig,
                                                 OptimSection, PipelineSchedule, Strategy)


@dataclass(frozen=True)
class CriticModelConfig(ModelConfig):
    fsdp_config: FSDPConfig
    """verl's older placement of `critic.fsdp_config`: a field set here (not null) overrides that one."""


@dataclass(frozen=True)
class CriticConfig:
    enable: Optional[bool]
    """Run a critic; null: exactly when `algorithm.adv_estimator=gae`."""
    strategy: Strategy
    """Training backend: `fsdp2`."""
    model: CriticModelConfig
    """The value model (by default the actor's model with a value head)."""
    ppo_mini_batch_size: int
    """Prompts per critic optimizer step (times `rollout.n` samples)."""
    ppo_micro_batch_size_per_gpu: Optional[int]
    """Samples per static micro-batch of the critic update."""
    forward_micro_batch_size_per_gpu: Optional[int]
    """Samples per static micro-batch of the value pass."""
    use_dynamic_bsz: bool
    """Token-budget micro-batches for the critic."""
    ppo_max_token_len_per_gpu: int
    """Dynamic token budget per device of the critic update."""
    forward_max_token_len_per_gpu: int
    """Dynamic token budget per device of the value pass."""
    ulysses_sequence_parallel_size: int
    """The critic's Ulysses SP group size."""
    ppo_epochs: int
    """Passes over each step's samples."""
    shuffle: bool
    """Shuffle the samples into mini-batches each epoch."""
    data_loader_seed: Optional[int]
    """Accepted for verl compatibility, no effect here (mini-batch shuffling uses `trainer.seed`)."""
    grad_clip: float
    """Clip the critic's global gradient norm to this (> 0)."""
    cliprange_value: float
    """Value clip range around the old values (> 0)."""
    loss_agg_mode: LossAggMode
    """How token losses aggregate (the actor's values)."""
    loss_scale_factor: Optional[float]
    """Horizon of `seq-mean-token-sum-norm`; null: the response width."""
    optim: OptimSection
    """The critic's optimizer."""
    fsdp_config: FSDPConfig
    """The critic's FSDP2 sharding and offload."""
    megatron: MegatronSection
    """verl's pipeline sizes for the critic's engine (`pipeline_model_parallel_size` > 1: the pipeline engine)."""
    pipeline_schedule: PipelineSchedule
    """Ballast: the pipeline schedule, `1f1b`, `interleaved_1f1b` or `zero_bubble` (used with
    `megatron.pipeline_model_parallel_size` > 1; virtual stages need one of the last two)."""
