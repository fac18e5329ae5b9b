"""What the driver tells each worker at construction (frozen, built once from the validated config),
and the typed argument of every generate call (`GenerateArgs`).

Workers never see the hydra config or divide batch sizes themselves; every per-rank size comes from
`ballast.trainer.config.DerivedSizes` through these objects. Loss functions arrive as callables (the
algorithms live with the driver).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from ballast.engine import EngineConfig
from ballast.workers.agent_loop.config import AgentLoopSpec
from ballast.workers.rollout import RolloutConfig, SamplingConfig
from ballast.workers.sync_check import PROBE_TOKENS

if TYPE_CHECKING:
    from ballast.single_controller.object_store import StoredWeights


@dataclass(frozen=True)
class TrainLoopSpec:
    """The loss and forward options of an `update_*` call; its mini-batches, epochs and micro-batches
    come with every call, in the driver's plan."""

    loss_fn: Callable
    temperature: float = 1.0
    calculate_entropy: bool = False
    # Adaptive clipping: below `grad_clip_min_batch_size` samples in a mini-batch (global), the clip
    # threshold scales linearly with the sample count. None: fixed `EngineConfig.grad_clip`.
    grad_clip_min_batch_size: Optional[int] = None


@dataclass(frozen=True)
class WeightSyncSpec:
    """How the actor's weights reach the rollout engine after an update. `layered`: gather at most one
    decoder layer at a time (verl's `rollout.layered_summon`). `check`: after every sync, compare the
    rollout engine's log-probs on a fixed probe with the actor's (`ballast.workers.sync_check`) and fail
    the run beyond `check_tolerance` mean absolute difference (None: calibrated at start-up). The probe
    is tokenized with the tokenizer in `tokenizer_path` and cut to `probe_max_tokens` (at most the
    rollout engine's context). `transfer_dtype`: a rollout pool of its own receives the weights in this
    dtype (the rollout's `dtype` setting, "auto" resolved on the trainer's device; None: the trainer's own)."""

    layered: bool = False
    check: bool = False
    check_tolerance: Optional[float] = None
    transfer_dtype: Optional[str] = None
    tokenizer_path: Optional[str] = None
    probe_max_tokens: int = PROBE_TOKENS

    def __post_init__(self) -> None:
        if self.check_tolerance is not None and not self.check_tolerance > 0:
            raise ValueError(f"check_tolerance={self.check_tolerance!r} must be > 0 or None")
        if self.check and self.tokenizer_path is None:
            raise ValueError("the weight-sync check needs tokenizer_path (its probe is text in the model's tokens)")
        if self.probe_max_tokens < 2:
            raise ValueError(f"probe_max_tokens={self.probe_max_tokens} must be >= 2")


@dataclass(frozen=True)
class ActorRolloutRefSpec:
    """Roles of one colocated actor/rollout/ref process and everything each role needs."""

    actor: Optional[EngineConfig]
    actor_train: Optional[TrainLoopSpec]
    rollout: Optional[RolloutConfig]
    rollout_val_sampling: Optional[SamplingConfig]
    ref: Optional[EngineConfig]
    temperature: float = 1.0
    # the rollout's agent loops (every generate call runs them; set exactly when the rollout role is)
    agent: Optional[AgentLoopSpec] = None
    seed: int = 0
    dist_timeout_s: float = 1800.0
    # The reference log-probs come from the actor with its LoRA adapter switched off (no ref engine).
    ref_in_actor: bool = False
    weight_sync: WeightSyncSpec = WeightSyncSpec()

    def __post_init__(self) -> None:
        if self.actor is None and self.rollout is None and self.ref is None:
            raise ValueError("an ActorRolloutRefSpec needs at least one of actor, rollout, ref")
        if self.actor is not None and self.actor_train is None:
            raise ValueError("the actor role needs actor_train")
        if self.ref_in_actor and (self.ref is not None or self.actor is None or not self.actor.lora.enabled):
            raise ValueError("ref_in_actor needs an actor with a LoRA adapter and no separate ref engine")
        if (self.agent is None) != (self.rollout is None):
            raise ValueError("the rollout role and its agent-loop spec come together: set both or neither")


@dataclass(frozen=True)
class GenerateArgs:
    """One generate call's arguments beside its prompts. `call_index` enters every sampling seed (the
    driver pins it to the step, so a resumed run samples as an uninterrupted one; None: the engine's
    call count); `validate` switches to the validation sampling parameters, and a validation call keeps
    the weights it started with (partial rollouts interrupt training generations only); `weights`: a
    rollout pool of its own gets the trainer's newest export with the first call after it."""

    call_index: Optional[int] = None
    validate: bool = False
    weights: Optional[StoredWeights] = None


@dataclass(frozen=True)
class CriticSpec:
    critic: EngineConfig
    train: TrainLoopSpec
    seed: int = 0
    dist_timeout_s: float = 1800.0
