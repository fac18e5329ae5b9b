"""Schema of `actor_rollout_ref.actor` and `actor_rollout_ref.ref`: the policy's update and the
reference model's log-prob pass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from ballast.trainer.config.schema.model import (FSDPConfig, LossAggMode, MegatronSection, OptimSection,
                                                 PipelineSchedule, Strategy)


@dataclass(frozen=True)
class PolicyLossConfig:
    loss_mode: str
    """Policy loss: `vanilla` (PPO clip, with clip-higher and dual clip), `gspo`, `gpg` or `geo_mean`."""


@dataclass(frozen=True)
class ActorConfig:
    strategy: Strategy
    """Training backend: `fsdp2` (verl's `fsdp`, FSDP1, is a start-up error asking for `fsdp2`)."""
    ppo_mini_batch_size: int
    """Prompts per optimizer step (times `rollout.n` samples); divides `data.train_batch_size`."""
    ppo_micro_batch_size_per_gpu: Optional[int]
    """Samples per static micro-batch (the gradient-accumulation unit); unused with `use_dynamic_bsz`."""
    use_dynamic_bsz: bool
    """Cut micro-batches by a token budget instead of a sample count."""
    ppo_max_token_len_per_gpu: int
    """Dynamic token budget per device; a micro-batch holds at most this x the SP size real tokens."""
    dynamic_bsz_bucketing: bool
    """Never mix prompt-length buckets in one dynamic micro-batch (needs `use_dynamic_bsz`)."""
    bucket_boundaries: List[int]
    """Prompt-length bucket edges in tokens, positive and increasing (used with `dynamic_bsz_bucketing`)."""
    ppo_epochs: int
    """Passes over each step's samples."""
    shuffle: bool
    """Shuffle the samples into mini-batches each epoch (seeded by `trainer.seed`)."""
    ulysses_sequence_parallel_size: int
    """Ulysses SP group size; the data-parallel size is world size / this."""
    grad_clip: float
    """Clip the global gradient norm to this (> 0)."""
    grad_clip_adaptive: bool
    """Scale the clip threshold down for mini-batches smaller than `grad_clip_min_batch_size` samples."""
    grad_clip_min_batch_size: int
    """Samples in a mini-batch (all ranks) from which `grad_clip` applies in full (adaptive clipping)."""
    clip_ratio: float
    """PPO clip range where `clip_ratio_low` / `clip_ratio_high` are null; they default to verl's 0.2, so,
    as in verl, setting this alone does not move them."""
    clip_ratio_low: Optional[float]
    """Lower clip range (1 - low); null: `clip_ratio`."""
    clip_ratio_high: Optional[float]
    """Upper clip range (1 + high, DAPO's clip-higher); null: `clip_ratio`."""
    clip_ratio_c: float
    """Dual-clip bound for negative advantages (> 1)."""
    loss_agg_mode: LossAggMode
    """`token-mean`, `seq-mean-token-sum`, `seq-mean-token-mean` or `seq-mean-token-sum-norm`."""
    loss_scale_factor: Optional[float]
    """Horizon of `seq-mean-token-sum-norm`; null: the response width."""
    entropy_coeff: float
    """Weight of the entropy bonus (>= 0)."""
    calculate_entropy: bool
    """Compute and log the entropy in the update even when `entropy_coeff` is 0."""
    old_log_prob_from_update: bool
    """With one epoch and no reward KL penalty, the actor update computes the old log-probs itself (its
    first mini-batch's own, a forward-only pass over the rest before its first step) instead of a
    separate pass over every row; false: the separate pass, as verl."""
    use_prefix_grouper: bool
    """Run each prompt once for all its `rollout.n` samples in every actor and reference forward (the
    samples attend to one shared copy; same log-probs and gradients, fewer tokens). Needs
    `model.use_remove_padding`, no Ulysses, and a prompt's samples within one micro-batch."""
    use_torch_compile: bool
    """Accepted for verl compatibility, no effect here (the engine does not compile the model)."""
    data_loader_seed: Optional[int]
    """Accepted for verl compatibility, no effect here (mini-batch shuffling uses `trainer.seed`)."""
    use_kl_loss: bool
    """Add a KL penalty to the reference model to the loss (loads the reference model)."""
    kl_loss_coef: float
    """Weight of the KL loss (>= 0)."""
    kl_loss_type: str
    """KL estimator: `kl`/`k1`, `abs`, `mse`/`k2`, `low_var_kl`/`k3`; a trailing `+` takes k2's gradient."""
    policy_loss: PolicyLossConfig
    """Which policy loss."""
    optim: OptimSection
    """The actor's optimizer."""
    fsdp_config: FSDPConfig
    """The actor's FSDP2 sharding and offload."""
    megatron: MegatronSection
    """verl's pipeline sizes for the actor's engine (`pipeline_model_parallel_size` > 1: the pipeline engine)."""
    pipeline_schedule: PipelineSchedule
    """Ballast: the pipeline schedule, `1f1b`, `interleaved_1f1b` or `zero_bubble` (used with
    `megatron.pipeline_model_parallel_size` > 1; virtual stages need one of the last two)."""


@dataclass(frozen=True)
class RefConfig:
    log_prob_micro_batch_size_per_gpu: Optional[int]
    """Samples per micro-batch of the reference log-prob pass (static micro-batches)."""
    log_prob_use_dynamic_bsz: bool
    """Token-budget micro-batches for the reference log-prob pass."""
    log_prob_max_token_len_per_gpu: int
    """Dynamic token budget per device of the reference log-prob pass."""
    ulysses_sequence_parallel_size: int
    """The reference model's Ulysses SP group size."""
    fsdp_config: FSDPConfig
    """The reference model's FSDP2 offload (`param_offload` or `offload_policy`: FSDP2 CPU offload) and
    resharding; a null field is the actor's."""
    megatron: MegatronSection
    """verl's pipeline sizes for the reference engine (by default the actor's)."""
    pipeline_schedule: PipelineSchedule
    """Ballast: the reference engine's pipeline schedule (by default the actor's)."""
