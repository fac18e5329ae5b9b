"""Typed schema of Ballast's config, mirroring verl's key paths.

`ballast/configs/ppo_trainer.yaml` holds the defaults; these frozen dataclasses hold the types and,
in the docstring under each field, what the key means. The fields deliberately have no defaults of
their own, so the yaml is the one place a default lives and a key missing from it is caught by the
schema test. The loader merges the yaml into this schema (unknown keys, wrong types and values outside
a field's choices fail there, naming the key) and converts it into these objects, which are never
mutated afterwards. A field with a closed set of values is typed by a `Choice` (`choice.py`); a
field whose values come from a registry (advantage estimators, policy losses, KL estimators, loggers,
balance workloads) or whose owner checks it (`trainer.device` and the schedule by the engine, the
rollout backend and dtype by the rollout) stays a `str`. One module per section; this one holds the root.
"""

from __future__ import annotations

from dataclasses import dataclass

from ballast.trainer.config.schema.actor import ActorConfig, PolicyLossConfig, RefConfig
from ballast.trainer.config.schema.algorithm import (
    AlgorithmConfig, CustomRewardConfig, FilterGroupsConfig, KLControlConfig, KLControlType, OverlongBufferConfig,
    RewardConfig, RewardManagerName, RewardModelConfig,
)
from ballast.trainer.config.schema.choice import Choice
from ballast.trainer.config.schema.critic import CriticConfig, CriticModelConfig
from ballast.trainer.config.schema.data import DataConfig, Truncation
from ballast.trainer.config.schema.model import (FSDPConfig, LossAggMode, MixedPrecisionSection, ModelConfig,
                                                 OptimSection, Strategy)
from ballast.trainer.config.schema.rollout import RolloutMode, RolloutSection, ValKwargs
from ballast.trainer.config.schema.trainer import RayInitConfig, ResumeMode, TrainerConfig


@dataclass(frozen=True)
class ActorRolloutRefConfig:
    hybrid_engine: bool
    """Actor and rollout share one process; false only with `trainer.v1.trainer_mode=separate_async`
    (the rollout runs on its own pool), as verl's V1 trainer requires."""
    model: ModelConfig
    """The policy model (the reference model loads the same)."""
    actor: ActorConfig
    """The policy update."""
    ref: RefConfig
    """The reference model's log-prob pass (loaded only for a KL loss or KL in the reward)."""
    rollout: RolloutSection
    """Generation."""


@dataclass(frozen=True)
class BallastConfig:
    data: DataConfig
    """Prompts and batching."""
    actor_rollout_ref: ActorRolloutRefConfig
    """Policy, reference model and rollout."""
    critic: CriticConfig
    """Value model (GAE)."""
    custom_reward_function: CustomRewardConfig
    """A user score function."""
    reward_model: RewardModelConfig
    """Reward shaping (DAPO's overlong buffer)."""
    reward: RewardConfig
    """Score-function limits."""
    algorithm: AlgorithmConfig
    """Advantages and the in-reward KL."""
    trainer: TrainerConfig
    """The run."""
    ray_init: RayInitConfig
    """The Ray cluster."""


__all__ = [
    "ActorConfig", "ActorRolloutRefConfig", "AlgorithmConfig", "BallastConfig", "Choice", "CriticConfig",
    "CriticModelConfig", "CustomRewardConfig", "DataConfig", "FSDPConfig", "FilterGroupsConfig", "KLControlConfig",
    "KLControlType", "LossAggMode", "MixedPrecisionSection", "ModelConfig", "OptimSection", "OverlongBufferConfig",
    "PolicyLossConfig",
    "RayInitConfig", "RefConfig", "ResumeMode", "RewardConfig", "RewardManagerName", "RewardModelConfig",
    "RolloutMode", "RolloutSection", "Strategy", "TrainerConfig", "Truncation", "ValKwargs",
]
