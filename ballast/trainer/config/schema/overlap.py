"""Schema of verl's V1 trainer keys (`trainer.use_v1`, `trainer.v1.*`) and of Ballast's own overlap keys
(`trainer.ballast_overlap.*`): how generation overlaps training. What each value does, and which of
verl's are refused, is decided in one place, `ballast.trainer.config.off_policy.overlap`
(docs/off_policy.md has the key-by-key comparison with verl)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from ballast.trainer.config.schema.choice import choice

# verl's V1 trainer modes (`trainer.v1.trainer_mode`).
TrainerMode = choice("TrainerMode", __name__, "sync", "colocate_async", "separate_async")
# verl's handling of a sample past `max_off_policy_threshold`.
OffPolicyStrategy = choice("OffPolicyStrategy", __name__, "drop", "wait")


@dataclass(frozen=True)
class SyncConfig:
    """verl's `trainer.v1.sync` section: empty (the synchronous trainer has no settings)."""


@dataclass(frozen=True)
class ColocateAsyncConfig:
    num_warmup_batches: float
    """Accepted for verl compatibility: read only by `trainer_mode=colocate_async`, which Ballast refuses
    at start-up (verl's mode resumes interrupted generations colocated; see docs/off_policy.md)."""


@dataclass(frozen=True)
class HybridRolloutConfig:
    enable_switch: bool
    """verl: lend the trainer's idle devices to generation. That needs rollout replicas beside the trainer
    (`hybrid_engine=true`), which `separate_async` does not build here; like verl with
    `hybrid_engine=false`, Ballast ignores it and says so at start-up."""
    switch_threshold_ratio: float
    """Accepted for verl compatibility, no effect (read only with `enable_switch`)."""
    adaptive_switch_threshold: bool
    """Accepted for verl compatibility, no effect (read only with `enable_switch`)."""
    switch_threshold_step_up: float
    """Accepted for verl compatibility, no effect (read only with `enable_switch`)."""
    switch_threshold_step_down: float
    """Accepted for verl compatibility, no effect (read only with `enable_switch`)."""
    switch_threshold_release_steps: int
    """Accepted for verl compatibility, no effect (read only with `enable_switch`)."""
    switch_cost_window_size: int
    """Accepted for verl compatibility, no effect (read only with `enable_switch`)."""


@dataclass(frozen=True)
class SeparateAsyncConfig:
    num_warmup_batches: float
    """verl's prefetch window: batches submitted before the first step, each step submitting one more, so
    this many whole batches are generated ahead on the rollout pool while the trainer trains (a whole
    number; the bound on a sample's age is then `trainer.v1.sampler.max_off_policy_threshold`)."""
    parameter_sync_step: int
    """Local PPO updates per step (verl's meaning): each on its own `1/parameter_sync_step` of the step's
    prompts, with its own values, advantages, critic and actor update, the old log-probs of every share
    from the step's starting weights; the weights reach the rollout pool once per step, after all of
    them, and the learning-rate schedule counts local updates (its horizon is this many times the
    steps). `data.train_batch_size` must equal it times `actor_rollout_ref.actor.ppo_mini_batch_size`."""
    hybrid_rollout: HybridRolloutConfig
    """verl's switching of idle trainer devices to generation (not built here)."""
    partial_rollout: Optional[bool]
    """Not one of verl's keys: Ballast's former spelling of `trainer.ballast_overlap.partial_rollout`,
    kept only so that a value set here stops the run at start-up naming the new key."""


@dataclass(frozen=True)
class CustomSamplerConfig:
    path: Optional[str]
    """verl: a file holding a replay-buffer class of the user's; Ballast has no replay buffer to replace,
    so a value is a start-up error."""
    name: Optional[str]
    """verl: that class's name; a value is a start-up error, as for `path`."""


@dataclass(frozen=True)
class SamplerConfig:
    max_off_policy_threshold: Optional[int]
    """verl's bound on how many model versions a trained sample can span (the step that trains it minus
    the step that submitted its prompt, plus one); null: no bound. With `separate_async` every batch
    spans at most `num_warmup_batches + 1`, which must not exceed it (a start-up error otherwise: verl
    would drop or wait for such samples, Ballast trains whole batches in launch order and drops none)."""
    max_off_policy_strategy: OffPolicyStrategy
    """Accepted for verl compatibility (verl: `drop` evicts groups past the bound, `wait` holds sampling
    while a group at the bound is still generating): within the start-up rule above no sample passes
    the bound, and every step waits for its whole batch anyway, so both run the same."""
    sync_refill_failed_groups: bool
    """Accepted for verl compatibility, no effect: a generation that fails stops the run here, so no prompt
    group is ever left without samples to replace."""
    custom_sampler: CustomSamplerConfig
    """verl's hook for a replay buffer of the user's (refused: see `path`)."""
    sampler_kwargs: Dict[str, Any]
    """Accepted for verl compatibility, no effect (verl passes them to its replay buffer; only a custom
    sampler reads them)."""


@dataclass(frozen=True)
class TrainerV1Config:
    trainer_mode: TrainerMode
    """`sync` (colocated, synchronous unless `trainer.ballast_overlap.batches_ahead` asks for Ballast's
    own overlap), `separate_async` (the rollout on a pool of its own, generating while the trainer
    trains) or `colocate_async` (verl's colocated partial rollouts: a start-up error naming what Ballast
    offers instead)."""
    sync: SyncConfig
    """Settings of `trainer_mode=sync` (none)."""
    colocate_async: ColocateAsyncConfig
    """Settings of `trainer_mode=colocate_async` (refused)."""
    separate_async: SeparateAsyncConfig
    """Settings of `trainer_mode=separate_async`."""
    sampler: SamplerConfig
    """verl's replay-buffer settings: the staleness bound of the asynchronous modes."""


@dataclass(frozen=True)
class BallastOverlapConfig:
    batches_ahead: int
    """Ballast's own colocated overlap (`trainer_mode=sync`): the batches of the next k steps are generated
    on the same workers while a step trains, nothing is interrupted, and every sample is at most k
    updates old; 0: the synchronous trainer. With `separate_async` it must be 0 (the window there is
    `trainer.v1.separate_async.num_warmup_batches`)."""
    partial_rollout: Optional[bool]
    """Whether new weights interrupt the generations in flight, which resume under them (each token's
    weight version is recorded). null: as verl's mode (on with `separate_async`; off colocated).
    false with `separate_async`: every batch ahead
    finishes on the weights it started with (at most `num_warmup_batches` updates old). true colocated
    is verl's `colocate_async`: refused."""
