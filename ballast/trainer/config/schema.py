"""Typed schema of Ballast's config, mirroring verl's key paths.

`ballast/configs/ppo_trainer.yaml` holds the defaults; these frozen dataclasses hold the types. The
fields deliberately have no defaults of their own, so the yaml is the one place a default lives and a
key missing from it is caught by the schema test. The loader merges the yaml into this schema (unknown
keys and wrong types fail there, naming the key) and converts it into these objects, which are never
mutated afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional


@dataclass(frozen=True)
class DataConfig:
    train_files: Any  # a path or a list of paths (verl accepts both); normalised to a list on load
    val_files: Any  # null, a path or a list of paths
    prompt_key: str
    reward_fn_key: str
    max_prompt_length: int
    max_response_length: int
    train_batch_size: int
    gen_batch_size: Optional[int]  # DAPO recipe: prompts per generation batch with filter_groups (null: train_batch_size)
    val_batch_size: Optional[int]
    truncation: str
    return_raw_chat: bool
    filter_overlong_prompts: bool
    shuffle: bool
    seed: int
    dataloader_num_workers: int
    prefetch_factor: int
    persistent_workers: bool


@dataclass(frozen=True)
class ModelConfig:
    path: str
    tokenizer_path: Optional[str]
    use_remove_padding: bool
    enable_gradient_checkpointing: bool
    trust_remote_code: bool


@dataclass(frozen=True)
class CriticModelFSDPConfig:
    """verl's older placement of the critic's FSDP switches (`critic.model.fsdp_config.*`); null: unset."""

    param_offload: Optional[bool]
    optimizer_offload: Optional[bool]
    offload_policy: Optional[bool]


@dataclass(frozen=True)
class CriticModelConfig(ModelConfig):
    fsdp_config: CriticModelFSDPConfig


@dataclass(frozen=True)
class OptimSection:
    lr: float
    betas: List[float]
    weight_decay: float
    lr_warmup_steps: int
    lr_warmup_steps_ratio: float
    lr_scheduler_type: str
    warmup_style: Optional[str]  # verl's deprecated spelling; when set it overrides lr_scheduler_type
    min_lr_ratio: float
    total_training_steps: int


@dataclass(frozen=True)
class FSDPConfig:
    param_offload: bool
    optimizer_offload: bool
    offload_policy: bool
    reshard_after_forward: bool
    fsdp_size: int  # -1: shard over every worker (the only layout Ballast implements)


@dataclass(frozen=True)
class RefFSDPConfig:
    param_offload: bool
    offload_policy: bool
    reshard_after_forward: bool


@dataclass(frozen=True)
class PolicyLossConfig:
    loss_mode: str


@dataclass(frozen=True)
class ActorConfig:
    strategy: str
    ppo_mini_batch_size: int
    ppo_micro_batch_size_per_gpu: Optional[int]
    use_dynamic_bsz: bool
    ppo_max_token_len_per_gpu: int
    dynamic_bsz_bucketing: bool
    bucket_boundaries: List[int]
    ppo_epochs: int
    shuffle: bool
    ulysses_sequence_parallel_size: int
    grad_clip: float
    grad_clip_adaptive: bool
    grad_clip_min_batch_size: int
    clip_ratio: float
    clip_ratio_low: Optional[float]
    clip_ratio_high: Optional[float]
    clip_ratio_c: float
    loss_agg_mode: str
    loss_scale_factor: Optional[float]
    entropy_coeff: float
    calculate_entropy: bool
    use_torch_compile: bool
    data_loader_seed: Optional[int]
    use_kl_loss: bool
    kl_loss_coef: float
    kl_loss_type: str
    policy_loss: PolicyLossConfig
    optim: OptimSection
    fsdp_config: FSDPConfig


@dataclass(frozen=True)
class RefConfig:
    log_prob_micro_batch_size_per_gpu: Optional[int]
    log_prob_use_dynamic_bsz: bool
    log_prob_max_token_len_per_gpu: int
    ulysses_sequence_parallel_size: int
    fsdp_config: RefFSDPConfig


@dataclass(frozen=True)
class ValKwargs:
    top_k: int
    top_p: float
    temperature: float
    n: int
    do_sample: bool


@dataclass(frozen=True)
class RolloutSection:
    name: str
    mode: str
    temperature: float
    top_k: int
    top_p: float
    do_sample: bool
    n: int
    prompt_length: int
    response_length: int
    dtype: str
    gpu_memory_utilization: float
    kv_cache_memory_bytes: Optional[int]
    cpu_kv_cache_gib: int
    ignore_eos: bool
    enforce_eager: bool
    free_cache_engine: bool
    tensor_model_parallel_size: int
    max_num_batched_tokens: int
    max_model_len: Optional[int]
    max_num_seqs: int
    enable_chunked_prefill: bool
    calculate_log_probs: bool
    seed: int
    log_prob_micro_batch_size_per_gpu: Optional[int]
    log_prob_use_dynamic_bsz: bool
    log_prob_max_token_len_per_gpu: int
    val_kwargs: ValKwargs


@dataclass(frozen=True)
class ActorRolloutRefConfig:
    hybrid_engine: bool
    model: ModelConfig
    actor: ActorConfig
    ref: RefConfig
    rollout: RolloutSection


@dataclass(frozen=True)
class CriticConfig:
    enable: Optional[bool]
    strategy: str
    model: CriticModelConfig
    ppo_mini_batch_size: int
    ppo_micro_batch_size_per_gpu: Optional[int]
    forward_micro_batch_size_per_gpu: Optional[int]
    use_dynamic_bsz: bool
    ppo_max_token_len_per_gpu: int
    forward_max_token_len_per_gpu: int
    ulysses_sequence_parallel_size: int
    ppo_epochs: int
    shuffle: bool
    data_loader_seed: Optional[int]
    grad_clip: float
    cliprange_value: float
    loss_agg_mode: str
    loss_scale_factor: Optional[float]
    optim: OptimSection
    fsdp_config: FSDPConfig


@dataclass(frozen=True)
class CustomRewardConfig:
    path: Optional[str]
    name: str


@dataclass(frozen=True)
class KLControlConfig:
    type: str
    kl_coef: float
    horizon: int
    target_kl: float


@dataclass(frozen=True)
class FilterGroupsConfig:
    enable: bool
    metric: str
    max_num_gen_batches: int


@dataclass(frozen=True)
class OverlongBufferConfig:
    enable: bool
    len: int
    penalty_factor: float
    log: bool


@dataclass(frozen=True)
class RewardModelConfig:
    reward_manager: str
    overlong_buffer: OverlongBufferConfig


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str
    gamma: float
    lam: float
    norm_adv_by_std_in_grpo: bool
    use_kl_in_reward: bool
    kl_penalty: str
    kl_ctrl: KLControlConfig
    filter_groups: FilterGroupsConfig


@dataclass(frozen=True)
class TrainerConfig:
    device: str
    nnodes: int
    n_gpus_per_node: int
    total_epochs: int
    total_training_steps: Optional[int]
    project_name: str
    experiment_name: str
    logger: List[str]
    balance_batch: bool
    balance_workload: str
    balance_keep_groups: bool
    critic_warmup: int
    save_freq: int
    test_freq: int
    val_before_train: bool
    val_only: bool
    resume_mode: str
    resume_from_path: Optional[str]
    default_local_dir: str
    max_actor_ckpt_to_keep: Optional[int]
    seed: int
    enable_monitor: bool
    monitor_interval: int
    worker_timeout_s: float
    max_consecutive_nonfinite_steps: int
    save_on_signal: bool
    move_old_run_aside: bool


@dataclass(frozen=True)
class RewardConfig:
    timeout_s: Optional[float]  # per call of the score function; null: no limit (runs on the main thread)


@dataclass(frozen=True)
class RayInitConfig:
    address: Optional[str]
    num_cpus: Optional[int]
    dashboard_host: str
    timeout_s: float


@dataclass(frozen=True)
class BallastConfig:
    data: DataConfig
    actor_rollout_ref: ActorRolloutRefConfig
    critic: CriticConfig
    custom_reward_function: CustomRewardConfig
    reward_model: RewardModelConfig
    reward: RewardConfig
    algorithm: AlgorithmConfig
    trainer: TrainerConfig
    ray_init: RayInitConfig
