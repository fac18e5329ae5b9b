"""How generation overlaps training: verl's V1 trainer keys and Ballast's own, decided in one place.

Ballast has one overlap mechanism (`ballast.trainer.step.rollout_pipeline`): whole batches generated
k steps ahead of the one being trained, taken in launch order, optionally interrupted by newer weights
(partial rollouts). `overlap(cfg)` reads every key that shapes it and returns the one `Overlap` the
trainer, the builders and the workers follow:

* `trainer.v1.trainer_mode=sync` (verl's default): colocated. Ballast's own
  `trainer.ballast_overlap.batches_ahead=k` generates the next k batches on the same workers while a
  step trains, nothing interrupted: every sample at most k updates old (0: verl's synchronous trainer).
* `trainer.v1.trainer_mode=separate_async`: the rollout on a pool of its own. verl's keys mean what they
  mean there: `num_warmup_batches` is the window (k whole batches ahead), the new weights interrupt the
  generations in flight (partial rollouts, on unless `trainer.ballast_overlap.partial_rollout=false`),
  `parameter_sync_step` P local PPO updates per step, and `trainer.v1.sampler.max_off_policy_threshold`
  bounds a sample's span, which here is at most k + 1 (checked at start-up).
* `trainer.v1.trainer_mode=colocate_async`: verl resumes interrupted generations colocated and samples
  the first-finished groups from a replay buffer; Ballast does not, and refuses it at start-up, naming
  what it offers instead. `trainer.use_v1=false` is verl's legacy synchronous trainer.

Stale samples (k >= 1) are off-policy, so when the config names no correction of its own the loader
turns on verl's one-step-off default before the config is frozen: bypass mode (the rollout's log-probs
are the old policy) with the rollout's log-probs computed, and says so at start-up. Any
`algorithm.rollout_correction` setting of the user's (rollout_is, rollout_rs or bypass_mode) is kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from ballast.trainer.config.errors import ConfigError

MODE_KEY = "trainer.v1.trainer_mode"
AHEAD_KEY = "trainer.ballast_overlap.batches_ahead"
PARTIAL_KEY = "trainer.ballast_overlap.partial_rollout"
WINDOW_KEY = "trainer.v1.separate_async.num_warmup_batches"
SYNC_STEP_KEY = "trainer.v1.separate_async.parameter_sync_step"
THRESHOLD_KEY = "trainer.v1.sampler.max_off_policy_threshold"
MOVED_PARTIAL_KEY = "trainer.v1.separate_async.partial_rollout"
COLOCATE_ASYNC_REFUSED = (
    f"{MODE_KEY}=colocate_async is verl's colocated asynchronous trainer: it aborts the generations in flight "
    "when a step's samples are taken, resumes them under the new weights (partial rollouts) and samples the "
    "first-finished prompt groups from a replay buffer (trainer.v1.sampler.*). Ballast does not interrupt "
    f"colocated generations. Use {AHEAD_KEY}=k instead (colocated, with {MODE_KEY}=sync: the next k whole "
    f"batches are generated while a step trains, every sample at most k updates old), or {MODE_KEY}="
    "separate_async (the rollout on a pool of its own, with partial rollouts); see docs/off_policy.md")


@dataclass(frozen=True)
class Overlap:
    """The run's overlap of generation and training (module docstring)."""

    split_pools: bool
    """The rollout runs on a resource pool of its own (`separate_async`)."""
    batches_ahead: int
    """k: whole batches generated ahead of the step being trained (0: synchronous)."""
    partial_rollout: bool
    """New weights interrupt the generations in flight (split pools with k >= 1 only)."""
    local_updates: int
    """PPO updates per step, each on its share of the prompts (verl's `parameter_sync_step`)."""


def split_pools(cfg) -> bool:
    """Whether the rollout runs on a resource pool of its own (`separate_async`)."""
    return cfg.trainer.use_v1 and cfg.trainer.v1.trainer_mode == "separate_async"


def whole_batches(value, key: str) -> int:
    """A window of `value` batches as a whole number >= 0: Ballast launches whole batches, so a fraction
    (verl counts its window in prompts) is an error rather than a silently different window."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r} must be a whole number of batches >= 0") from None
    if not (number >= 0 and number == int(number)):
        raise ConfigError(f"{key}={value!r} must be a whole number of batches >= 0: Ballast generates whole "
                          "batches ahead (verl counts a fractional window in prompts, which Ballast does not offer)")
    return int(number)


def overlap(cfg) -> Overlap:
    """The run's `Overlap`; a mode Ballast refuses is a ConfigError naming what to use instead."""
    t = cfg.trainer
    if t.use_v1 and t.v1.trainer_mode == "colocate_async":
        raise ConfigError(COLOCATE_ASYNC_REFUSED)
    if split_pools(cfg):
        sep = t.v1.separate_async
        ahead = whole_batches(sep.num_warmup_batches, WINDOW_KEY)
        wanted = t.ballast_overlap.partial_rollout is not False
        return Overlap(True, ahead, wanted and ahead >= 1, sep.parameter_sync_step)
    ahead = t.ballast_overlap.batches_ahead
    if ahead is None or ahead < 0:
        raise ConfigError(f"{AHEAD_KEY}={ahead!r} must be a whole number of batches >= 0")
    return Overlap(False, ahead, False, 1)


def _plain_batches_ahead(plain: dict) -> int:
    """k from the untyped config (0 where a value is bad: the start-up rules name it)."""
    t = plain.get("trainer") or {}
    v1 = t.get("v1") or {}
    mode = v1.get("trainer_mode", "sync") if t.get("use_v1", True) else "sync"
    if mode == "separate_async":
        value = (v1.get("separate_async") or {}).get("num_warmup_batches", 0)
    elif mode == "sync":
        value = (t.get("ballast_overlap") or {}).get("batches_ahead", 0)
    else:
        return 0
    try:
        return whole_batches(value, "")
    except ConfigError:
        return 0


def prepare_off_policy(plain: dict) -> List[str]:
    """Before the config is typed: turn on the correction stale samples need when the user chose none
    (module docstring). Returns the lines to print at start-up (empty when nothing was set)."""
    t = plain.get("trainer") or {}
    lines = []
    hybrid = ((t.get("v1") or {}).get("separate_async") or {}).get("hybrid_rollout") or {}
    if hybrid.get("enable_switch") and t.get("use_v1", True) and (t.get("v1") or {}).get("trainer_mode") == "separate_async":
        lines.append("[ballast] trainer.v1.separate_async.hybrid_rollout.enable_switch=true is ignored, as verl does "
                     "with actor_rollout_ref.hybrid_engine=false: no rollout replicas are built beside the trainer")
    ahead = _plain_batches_ahead(plain)
    if ahead <= 0:
        return lines
    rc = plain.setdefault("algorithm", {}).setdefault("rollout_correction", {})
    if rc.get("rollout_is") is not None or rc.get("rollout_rs") is not None or rc.get("bypass_mode"):
        return lines
    rc["bypass_mode"] = True
    plain.setdefault("actor_rollout_ref", {}).setdefault("rollout", {})["calculate_log_probs"] = True
    return lines + [f"[ballast] {ahead} batch(es) generated ahead: samples up to {ahead} update(s) old, so rollout "
                    "correction is on by default (algorithm.rollout_correction.bypass_mode=true, actor_rollout_ref."
                    "rollout.calculate_log_probs=true; set algorithm.rollout_correction.* to choose another)"]


def check_off_policy(cfg) -> None:
    """Start-up rules of the overlap keys; ConfigError names the keys."""
    t = cfg.trainer
    if t.v1.separate_async.partial_rollout is not None:
        raise ConfigError(f"{MOVED_PARTIAL_KEY} is not one of verl's keys (verl's separate_async always resumes "
                          f"interrupted generations); Ballast's switch is {PARTIAL_KEY} (null, the default: on with "
                          "separate_async, as verl; false: every batch ahead keeps the weights it started with)")
    if not t.use_v1 and t.v1.trainer_mode != "sync":
        raise ConfigError(f"trainer.use_v1=false runs verl's legacy trainer, which is synchronous and reads no "
                          f"trainer.v1.* key, but {MODE_KEY}={t.v1.trainer_mode}: set trainer.use_v1=true for that "
                          "mode, or drop it")
    _check_sampler(t.v1.sampler)
    ov = overlap(cfg)
    if ov.split_pools:
        check_split_pools(cfg, ov)
    else:
        if not cfg.actor_rollout_ref.hybrid_engine:
            raise ConfigError(f"actor_rollout_ref.hybrid_engine=False with {MODE_KEY}={t.v1.trainer_mode}: the actor "
                              f"and the rollout share one process unless {MODE_KEY}=separate_async puts the rollout "
                              "on a pool of its own")
        if t.ballast_overlap.partial_rollout:
            raise ConfigError(f"{PARTIAL_KEY}=true needs {MODE_KEY}=separate_async: interrupting colocated generations "
                              f"is verl's colocate_async, which Ballast does not offer ({AHEAD_KEY}=k generates whole "
                              "batches ahead instead)")
    if ov.batches_ahead == 0:
        return
    rc = cfg.algorithm.rollout_correction
    if not (rc.bypass_mode or rc.rollout_is or rc.rollout_rs):
        key = WINDOW_KEY if ov.split_pools else AHEAD_KEY
        raise ConfigError(f"{key}={ov.batches_ahead} trains on samples up to {ov.batches_ahead} update(s) old, which "
                          "needs a rollout correction: set algorithm.rollout_correction.bypass_mode=true or a "
                          "rollout_is / rollout_rs mode (the loader sets bypass_mode when none is named)")


def _check_sampler(sampler) -> None:
    threshold = sampler.max_off_policy_threshold
    if threshold is not None and threshold < 1:
        raise ConfigError(f"{THRESHOLD_KEY}={threshold} must be an integer >= 1, or null for no bound")
    custom = sampler.custom_sampler
    if custom.path or custom.name:
        raise ConfigError(f"trainer.v1.sampler.custom_sampler (path={custom.path!r}, name={custom.name!r}) replaces "
                          "verl's replay buffer; Ballast has none (its batches are trained whole, in launch order): "
                          "leave it null")


def check_split_pools(cfg, ov: Overlap) -> None:
    """verl's rules for `separate_async`, and what Ballast's whole-batch window adds, with the keys."""
    arr, t = cfg.actor_rollout_ref, cfg.trainer
    if arr.hybrid_engine:
        raise ConfigError(f"{MODE_KEY}=separate_async needs actor_rollout_ref.hybrid_engine=false: the rollout runs only "
                          "on its own pool (rollout replicas beside the trainer's are not built)")
    r = arr.rollout
    for key, value in (("nnodes", r.nnodes), ("n_gpus_per_node", r.n_gpus_per_node)):
        if value <= 0:
            raise ConfigError(f"actor_rollout_ref.rollout.{key}={value} must be > 0 with {MODE_KEY}=separate_async "
                              "(the size of the rollout's own resource pool)")
    if t.ballast_overlap.batches_ahead:
        raise ConfigError(f"{AHEAD_KEY}={t.ballast_overlap.batches_ahead} is the colocated window; with {MODE_KEY}="
                          f"separate_async the batches generated ahead are verl's {WINDOW_KEY}: set it there")
    check_local_updates(cfg, ov)
    threshold = t.v1.sampler.max_off_policy_threshold
    if threshold is not None and ov.batches_ahead + 1 > threshold:
        raise ConfigError(
            f"{WINDOW_KEY}={ov.batches_ahead} keeps every batch in flight for {ov.batches_ahead + 1} steps, more than "
            f"{THRESHOLD_KEY}={threshold}: verl would drop (or wait for) those samples, while Ballast trains whole "
            f"batches in launch order and drops none; raise the threshold to >= {ov.batches_ahead + 1} (or null) "
            "or lower the window")
    gen = cfg.data.gen_batch_size
    if ov.batches_ahead and gen is not None and gen != cfg.data.train_batch_size:
        raise ConfigError(f"{WINDOW_KEY}={ov.batches_ahead} with data.gen_batch_size={gen} != data.train_batch_size="
                          f"{cfg.data.train_batch_size}: verl's window is then {ov.batches_ahead} x train_batch_size "
                          "prompts, Ballast's would be that many generation batches; set the window to 0 or "
                          "gen_batch_size to train_batch_size")


def check_local_updates(cfg, ov: Overlap) -> None:
    """`parameter_sync_step`: verl's rule (each local update is one mini-batch of the actor); the critic's
    mini-batches must fit a share too (`derived.py`, with the other sizes)."""
    arr, p = cfg.actor_rollout_ref, ov.local_updates
    if p < 1:
        raise ConfigError(f"{SYNC_STEP_KEY}={p} must be >= 1")
    if cfg.data.train_batch_size != p * arr.actor.ppo_mini_batch_size:
        raise ConfigError(
            f"data.train_batch_size={cfg.data.train_batch_size} must equal {SYNC_STEP_KEY}={p} x actor_rollout_ref."
            f"actor.ppo_mini_batch_size={arr.actor.ppo_mini_batch_size} (verl's rule: each of the step's local "
            "updates trains one mini-batch)")
