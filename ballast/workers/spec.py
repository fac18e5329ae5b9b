"""What the driver tells each worker at construction: frozen, built once from the validated config.

Workers never see the hydra config or divide batch sizes themselves; every per-rank size comes from
`ballast.trainer.config.DerivedSizes` through these objects. Loss functions arrive as callables (the
algorithms live with the driver).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ballast.engine import EngineConfig, MicroBatchSpec
from ballast.workers.rollout import RolloutConfig, SamplingConfig


@dataclass(frozen=True)
class TrainLoopSpec:
    """How `update_*` walks this rank's share of a step: mini-batches, epochs, shuffling."""

    mini_batch_samples_per_rank: int
    ppo_epochs: int
    shuffle: bool
    seed: int
    micro: MicroBatchSpec
    loss_fn: Callable
    temperature: float = 1.0
    calculate_entropy: bool = False
    # Adaptive clipping: below `grad_clip_min_batch_size` samples in a mini-batch (global), the clip
    # threshold scales linearly with the sample count. None: fixed `EngineConfig.grad_clip`.
    grad_clip_min_batch_size: Optional[int] = None

    def __post_init__(self) -> None:
        if self.mini_batch_samples_per_rank < 1 or self.ppo_epochs < 1:
            raise ValueError(f"mini_batch_samples_per_rank={self.mini_batch_samples_per_rank} and "
                             f"ppo_epochs={self.ppo_epochs} must be >= 1")


@dataclass(frozen=True)
class ActorRolloutRefSpec:
    """Roles of one colocated actor/rollout/ref process and everything each role needs."""

    actor: Optional[EngineConfig]
    actor_train: Optional[TrainLoopSpec]
    actor_infer: Optional[MicroBatchSpec]  # old log-probs (verl: rollout.log_prob_*)
    rollout: Optional[RolloutConfig]
    rollout_val_sampling: Optional[SamplingConfig]
    ref: Optional[EngineConfig]
    ref_infer: Optional[MicroBatchSpec]
    temperature: float = 1.0
    seed: int = 0
    dist_timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.actor is None and self.rollout is None and self.ref is None:
            raise ValueError("an ActorRolloutRefSpec needs at least one of actor, rollout, ref")
        if self.actor is not None and (self.actor_train is None or self.actor_infer is None):
            raise ValueError("the actor role needs actor_train and actor_infer")
        if self.ref is not None and self.ref_infer is None:
            raise ValueError("the ref role needs ref_infer")


@dataclass(frozen=True)
class CriticSpec:
    critic: EngineConfig
    train: TrainLoopSpec
    infer: MicroBatchSpec
    seed: int = 0
    dist_timeout_s: float = 1800.0
