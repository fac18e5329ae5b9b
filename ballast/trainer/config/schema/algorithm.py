"""Schema of the reward and algorithm sections: `custom_reward_function`, `reward_model`, `reward`,
`algorithm`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ballast.trainer.config.schema.choice import choice

# verl's reward managers Ballast has (`ballast.trainer.step.reward.REWARD_MANAGERS`; a test keeps the two equal).
RewardManagerName = choice("RewardManagerName", __name__, "naive", "dapo")
# The in-reward KL coefficient's controllers (`ballast.trainer.algorithms.kl`; a test keeps the two equal).
KLControlType = choice("KLControlType", __name__, "fixed", "adaptive")


@dataclass(frozen=True)
class CustomRewardConfig:
    path: Optional[str]
    """A .py file holding the score function; null: the built-in reward for each data source."""
    name: str
    """Name of the score function in that file."""


@dataclass(frozen=True)
class OverlongBufferConfig:
    enable: bool
    """DAPO's soft overlong punishment (needs `reward_model.reward_manager=dapo`)."""
    len: int
    """Answers longer than `data.max_response_length - len` tokens lose reward linearly."""
    penalty_factor: float
    """... reaching -penalty_factor at `data.max_response_length`."""
    log: bool
    """Log `reward_extra/overlong_reward/mean` and `reward_extra/overlong/mean`."""


@dataclass(frozen=True)
class LegacyRewardModelPath:
    path: Optional[str]
    """verl's legacy `reward_model.model.path`: moved to `reward.reward_model.model_path` when set."""


@dataclass(frozen=True)
class RewardModelConfig:
    enable: Optional[bool]
    """verl's legacy key: moved to `reward.reward_model.enable` when set (as are the next three)."""
    enable_resource_pool: Optional[bool]
    """Legacy `reward.reward_model.enable_resource_pool`."""
    n_gpus_per_node: Optional[int]
    """Legacy `reward.reward_model.n_gpus_per_node`."""
    nnodes: Optional[int]
    """Legacy `reward.reward_model.nnodes`."""
    model: LegacyRewardModelPath
    """Legacy `reward.reward_model.model_path`."""
    reward_manager: RewardManagerName
    """`naive` or `dapo` (verl's managers): `dapo` records a plain-number score as `acc` and applies the overlong buffer."""
    overlong_buffer: OverlongBufferConfig
    """DAPO's overlong reward shaping."""


@dataclass(frozen=True)
class ScoringModelConfig:
    enable: bool
    """Score every conversation with a discriminative reward model (docs/reward_models.md)."""
    enable_resource_pool: bool
    """The reward model on a pool of its own (`n_gpus_per_node` x `nnodes`); false: colocated with the trainer."""
    n_gpus_per_node: int
    """Devices (CPU: worker processes) per node of the reward model's own pool."""
    nnodes: int
    """Nodes of the reward model's own pool (> 0 with `enable_resource_pool`)."""
    model_path: Optional[str]
    """A local Hugging Face directory holding an `*ForSequenceClassification` with one label."""
    score_weight: float
    """Weight of the reward model's score in the reward (Ballast's key)."""
    rule_weight: float
    """Weight of the rule/function score (Ballast's key; 0: the reward model alone, as verl; the rule score is still logged)."""
    max_length: Optional[int]
    """Longest conversation the reward model reads, in its tokens (null: data.max_prompt_length + data.max_response_length, at most its max_position_embeddings - 1)."""
    use_remove_padding: bool
    """Packed (padding-free) forward, as the other roles' `use_remove_padding`."""
    micro_batch_size_per_gpu: Optional[int]
    """Static micro-batch rows per rank of the reward model's forward."""
    use_dynamic_bsz: bool
    """Token-budget micro-batches (`forward_max_token_len_per_gpu`) instead of static ones."""
    forward_max_token_len_per_gpu: int
    """Token budget of one micro-batch with `use_dynamic_bsz`."""


@dataclass(frozen=True)
class RewardConfig:
    timeout_s: Optional[float]
    """Longest one score-function call may take (then the run stops, exit 2); null: no limit, main thread."""
    reward_model: ScoringModelConfig
    """verl's `reward.reward_model.*`: a discriminative reward model in the reward path."""


@dataclass(frozen=True)
class KLControlConfig:
    type: KLControlType
    """In-reward KL coefficient: `fixed` or `adaptive`."""
    kl_coef: float
    """(Initial) KL coefficient."""
    horizon: int
    """Adaptive controller's horizon in samples (> 0)."""
    target_kl: float
    """Adaptive controller's target KL (> 0)."""


@dataclass(frozen=True)
class FilterGroupsConfig:
    enable: bool
    """DAPO's dynamic sampling: drop prompt groups whose answers all share one `metric` value."""
    metric: str
    """`reward` (= `seq_reward`, the rule score), `seq_final_reward` or a value the score function returns."""
    max_num_gen_batches: int
    """Generation batches per step before giving up; <= 0: no limit."""


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    rollout_is: Optional[str]
    """Importance weights for the rollout/training mismatch: null (none), `token` or `sequence` (docs/rollout_correction.md)."""
    rollout_is_threshold: Any
    """A number: truncate weights above it (TIS); `"lower_upper"`, e.g. `"0.5_5.0"`: zero them outside (IcePop)."""
    rollout_is_batch_normalize: bool
    """Divide the weights by their mean over the mini-batch (all DP ranks); needs `rollout_is`."""
    rollout_rs: Optional[str]
    """Rejection: comma-separated `token_k1..3`, `seq_sum_k1..3`, `seq_mean_k1..3`, `seq_max_k2/k3`; null: none."""
    rollout_rs_threshold: Any
    """One bound per `rollout_rs` option (or one for all): `"lower_upper"` ratio bounds for k1, an upper bound for k2/k3."""
    bypass_mode: bool
    """Use the rollout's log-probs as the old policy (no old-log-prob pass); false: decoupled (three policies)."""
    loss_type: str
    """Bypass mode's loss: `ppo_clip` (the ratio to the rollout policy, clipped) or `reinforce` (explicit weights)."""


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str
    """Advantage estimator: `gae`, `grpo`, `rloo`, `reinforce_plus_plus(_baseline)`, `grpo_passk`, `opo`, `gpg`."""
    gamma: float
    """Discount factor, in [0, 1]."""
    lam: float
    """GAE's lambda, in [0, 1]."""
    norm_adv_by_std_in_grpo: bool
    """GRPO: divide advantages by the group's standard deviation."""
    use_kl_in_reward: bool
    """Subtract a KL penalty to the reference model from the rewards (loads the reference model)."""
    kl_penalty: str
    """KL estimator of the in-reward penalty: `kl`, `abs`, `mse`, `low_var_kl` (and `+` forms)."""
    kl_ctrl: KLControlConfig
    """The in-reward KL coefficient's controller."""
    filter_groups: FilterGroupsConfig
    """DAPO's dynamic sampling."""
    rollout_correction: RolloutCorrectionConfig
    """verl's rollout correction (importance weights, rejection, decoupled or bypass mode); presets: `+algorithm/rollout_correction=<name>`."""
