"""Start-up validation: names, ranges and cross-key rules that a typed schema cannot express.

Everything here runs on the driver before any Ray actor exists, so an invalid config never reaches
a worker. Each rule is checked once, by its owner: batch divisibility lives with the sizes it
protects (`derived.py`); what the engine, rollout and data loader require of their own settings is
checked by them, when `check_config` builds their specs here, and reported with the config key
(`keys.py`). What is left in this file are rules about keys only the trainer reads.
"""

from __future__ import annotations

import os
from typing import Iterable, Literal, Optional, get_args

from ballast.trainer.config.derived import DerivedSizes, derive_sizes, uses_critic
from ballast.trainer.config.loader import ConfigError
from ballast.trainer.config.model_info import ModelInfo
from ballast.trainer.config.schema import BallastConfig, OptimSection

# Allowed values of keys only the trainer reads; the other sets are imported from their owners.
Strategy = Literal["fsdp2"]
RolloutMode = Literal["sync", "async"]
RewardManagerName = Literal["naive", "dapo"]
ResumeMode = Literal["auto", "disable", "resume_path"]
STRATEGIES = get_args(Strategy)
RESUME_MODES = get_args(ResumeMode)
# `flops` is a FlopsModel built from the actor's HF config; the named workloads are balance's.
BALANCE_WORKLOADS = ("flops",)
# Until the real step count is known (the data is read after this check), specs are built with this
# many steps; `training_session` builds them again with the real count before Ray starts.
PROVISIONAL_TOTAL_STEPS = 1 << 30


def _one_of(key: str, value, allowed: Iterable) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(repr, allowed))}")


def _at_least(key: str, value, low, inclusive: bool = True) -> None:
    if value is None or (value < low if inclusive else value <= low):
        raise ConfigError(f"{key}={value!r} must be {'>=' if inclusive else '>'} {low}")


def _in_unit(key: str, value: float, allow_zero: bool = False) -> None:
    if not ((0.0 <= value if allow_zero else 0.0 < value) and value <= 1.0):
        raise ConfigError(f"{key}={value!r} must be in {'[0' if allow_zero else '(0'}, 1]")


def check_config(cfg: BallastConfig, model: Optional[ModelInfo] = None) -> DerivedSizes:
    """Validate `cfg` (and its fit to `model`, when known) and return the derived sizes."""
    # Imported here: they load torch, and the config package is imported by tools that need neither.
    from ballast.trainer.algorithms import registered_names
    from ballast.trainer.builders import worker_specs

    names = registered_names()
    _check_names(cfg, names)
    _check_ranges(cfg)
    _check_rules(cfg)
    sizes = derive_sizes(cfg, model)
    gen = cfg.data.gen_batch_size
    if gen is not None and gen * cfg.actor_rollout_ref.rollout.n % sizes.rollout_dp:
        raise ConfigError(f"data.gen_batch_size * actor_rollout_ref.rollout.n = {gen * cfg.actor_rollout_ref.rollout.n} "
                          f"samples must divide over the {sizes.rollout_dp} rollout workers")
    worker_specs(cfg, sizes, cfg.trainer.total_training_steps or PROVISIONAL_TOTAL_STEPS)
    return sizes


def _check_names(cfg: BallastConfig, names: dict) -> None:
    from ballast.balance.workload import WORKLOAD_NAMES
    from ballast.data.dataset import TRUNCATION_MODES
    from ballast.engine.config import LR_SCHEDULES
    from ballast.trainer.algorithms.kl import make_kl_controller
    from ballast.trainer.tracking import LOGGERS

    arr, actor, t = cfg.actor_rollout_ref, cfg.actor_rollout_ref.actor, cfg.trainer
    _one_of("algorithm.adv_estimator", cfg.algorithm.adv_estimator, names["adv_estimator"])
    _one_of("actor_rollout_ref.actor.policy_loss.loss_mode", actor.policy_loss.loss_mode, names["policy_loss"])
    _one_of("actor_rollout_ref.actor.loss_agg_mode", actor.loss_agg_mode, names["loss_agg_mode"])
    _one_of("critic.loss_agg_mode", cfg.critic.loss_agg_mode, names["loss_agg_mode"])
    _one_of("actor_rollout_ref.actor.kl_loss_type", actor.kl_loss_type, names["kl_penalty"])
    _one_of("algorithm.kl_penalty", cfg.algorithm.kl_penalty, names["kl_penalty"])
    kl = cfg.algorithm.kl_ctrl
    try:  # the controller checks its own type and settings, naming the keys
        make_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    for key, strategy in (("actor_rollout_ref.actor.strategy", actor.strategy), ("critic.strategy", cfg.critic.strategy)):
        if strategy == "fsdp":
            raise ConfigError(
                f"{key}='fsdp' is verl's FSDP1 wrapper, which Ballast does not implement; Ballast's engine is "
                f"FSDP2: set {key}=fsdp2 (the same sharded data-parallel training)"
            )
        _one_of(key, strategy, STRATEGIES)
    for prefix, optim in (("actor_rollout_ref.actor.optim", actor.optim), ("critic.optim", cfg.critic.optim)):
        if optim.warmup_style is not None:
            # warmup_style overrides it, so the engine never sees (and checks) this one.
            _one_of(f"{prefix}.lr_scheduler_type", optim.lr_scheduler_type, LR_SCHEDULES)
    if not arr.hybrid_engine:
        raise ConfigError("actor_rollout_ref.hybrid_engine=False is not supported (verl's PPO trainer requires "
                          "True as well): the actor and rollout always share one process")
    _one_of("actor_rollout_ref.rollout.mode", arr.rollout.mode, get_args(RolloutMode))
    if arr.rollout.multi_turn.enable and arr.rollout.mode != "async":
        raise ConfigError("actor_rollout_ref.rollout.multi_turn.enable=True needs actor_rollout_ref.rollout.mode=async "
                          "(tool-calling conversations run as agent loops on request-level rollout)")
    _one_of("data.truncation", cfg.data.truncation, TRUNCATION_MODES)
    _one_of("trainer.balance_workload", t.balance_workload, WORKLOAD_NAMES + BALANCE_WORKLOADS)
    for i, name in enumerate(t.logger):
        _one_of(f"trainer.logger[{i}]", name, LOGGERS)
    if t.resume_mode not in RESUME_MODES and not os.path.isdir(os.path.expanduser(t.resume_mode)):
        raise ConfigError(
            f"trainer.resume_mode={t.resume_mode!r} is not one of {', '.join(map(repr, RESUME_MODES))} "
            "and not an existing checkpoint directory"
        )
    if t.resume_mode == "resume_path" and not t.resume_from_path:
        raise ConfigError("trainer.resume_mode='resume_path' needs trainer.resume_from_path")


def _check_optim(prefix: str, optim: OptimSection) -> None:
    # > 0 for a trained role (the engine also accepts 0, which the reference model uses).
    _at_least(f"{prefix}.lr", optim.lr, 0.0, inclusive=False)
    if len(optim.betas) != 2 or not all(0.0 <= b < 1.0 for b in optim.betas):
        raise ConfigError(f"{prefix}.betas={list(optim.betas)!r} must be two numbers in [0, 1)")
    _at_least(f"{prefix}.weight_decay", optim.weight_decay, 0.0)
    _in_unit(f"{prefix}.lr_warmup_steps_ratio", optim.lr_warmup_steps_ratio, allow_zero=True)


def _check_ranges(cfg: BallastConfig) -> None:
    data, arr, t = cfg.data, cfg.actor_rollout_ref, cfg.trainer
    actor, rollout = arr.actor, arr.rollout
    for key, value in (
        ("data.train_batch_size", data.train_batch_size), ("data.max_prompt_length", data.max_prompt_length),
        ("data.max_response_length", data.max_response_length), ("actor_rollout_ref.rollout.n", rollout.n),
        ("actor_rollout_ref.actor.ppo_epochs", actor.ppo_epochs), ("critic.ppo_epochs", cfg.critic.ppo_epochs),
        ("trainer.nnodes", t.nnodes), ("trainer.n_gpus_per_node", t.n_gpus_per_node),
        ("trainer.total_epochs", t.total_epochs), ("trainer.monitor_interval", t.monitor_interval),
        ("actor_rollout_ref.actor.grad_clip_min_batch_size", actor.grad_clip_min_batch_size),
        ("trainer.max_consecutive_nonfinite_steps", t.max_consecutive_nonfinite_steps),
    ):
        _at_least(key, value, 1)
    if t.total_training_steps is not None:
        _at_least("trainer.total_training_steps", t.total_training_steps, 1)
    if data.val_batch_size is not None:
        _at_least("data.val_batch_size", data.val_batch_size, 1)
    _at_least("trainer.worker_timeout_s", t.worker_timeout_s, 0.0, inclusive=False)
    if cfg.reward.timeout_s is not None:
        _at_least("reward.timeout_s", cfg.reward.timeout_s, 0.0, inclusive=False)
    _at_least("ray_init.timeout_s", cfg.ray_init.timeout_s, 0.0, inclusive=False)
    for key, value in (
        ("actor_rollout_ref.actor.clip_ratio", actor.clip_ratio),
        ("actor_rollout_ref.actor.clip_ratio_low", actor.clip_ratio_low),
        ("actor_rollout_ref.actor.clip_ratio_high", actor.clip_ratio_high),
        ("critic.cliprange_value", cfg.critic.cliprange_value),
    ):
        if value is not None:
            _at_least(key, value, 0.0, inclusive=False)
    _at_least("actor_rollout_ref.actor.clip_ratio_c", actor.clip_ratio_c, 1.0, inclusive=False)
    _at_least("actor_rollout_ref.actor.entropy_coeff", actor.entropy_coeff, 0.0)
    _at_least("actor_rollout_ref.actor.kl_loss_coef", actor.kl_loss_coef, 0.0)
    _in_unit("algorithm.gamma", cfg.algorithm.gamma, allow_zero=True)
    _in_unit("algorithm.lam", cfg.algorithm.lam, allow_zero=True)
    _check_optim("actor_rollout_ref.actor.optim", actor.optim)
    _check_optim("critic.optim", cfg.critic.optim)
    _at_least("actor_rollout_ref.rollout.val_kwargs.n", rollout.val_kwargs.n, 1)
    if rollout.val_kwargs.n > 1 and not rollout.val_kwargs.do_sample:
        raise ConfigError(
            f"actor_rollout_ref.rollout.val_kwargs.n={rollout.val_kwargs.n} with val_kwargs.do_sample=False would "
            "repeat one greedy answer: set val_kwargs.do_sample=True (and a temperature > 0)"
        )


def _check_fsdp_size(key: str, size, world: int) -> None:
    """`size` is an int the engine's rule accepts for `world` workers (`ballast.engine.dist.resolve_shard_size`)."""
    from ballast.engine.dist import resolve_shard_size

    try:
        if isinstance(size, bool) or not isinstance(size, int):
            raise ValueError(size)
        resolve_shard_size(size, world)
    except ValueError:
        raise ConfigError(f"{key}={size!r}: must be -1 (shard over all {world} workers) or an int that divides the "
                          f"{world} workers (hybrid sharding: {world} / fsdp_size replicas)") from None


def _check_offload(cfg: BallastConfig) -> None:
    """verl's offload switches: each means what verl means, or the run stops here naming the key."""
    arr = cfg.actor_rollout_ref
    switches = [
        ("actor_rollout_ref.actor.fsdp_config", arr.actor.fsdp_config),
        ("actor_rollout_ref.ref.fsdp_config", arr.ref.fsdp_config), ("critic.fsdp_config", cfg.critic.fsdp_config),
        ("critic.model.fsdp_config", cfg.critic.model.fsdp_config),
    ]
    for prefix, fsdp in switches:
        on = [k for k in ("param_offload", "optimizer_offload", "offload_policy") if getattr(fsdp, k, False)]
        if on and cfg.trainer.device == "cpu":
            raise ConfigError(
                f"{prefix}.{on[0]}=True offloads from GPU to host memory, but trainer.device=cpu keeps everything "
                f"in host memory already: set {prefix}.{on[0]}=False"
            )
        _check_fsdp_size(f"{prefix}.fsdp_size", getattr(fsdp, "fsdp_size", -1),
                         cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node)
        if prefix.endswith("ref.fsdp_config"):
            continue  # the reference model has no optimizer: param_offload = FSDP2 CPU offload, as verl means it
        for key in ("param_offload", "optimizer_offload"):
            if getattr(fsdp, key):
                raise ConfigError(
                    f"{prefix}.{key}=True (verl: move the {'parameters' if key == 'param_offload' else 'optimizer states'} "
                    f"to host memory between phases) is not implemented; {prefix}.offload_policy=True keeps "
                    "parameters, gradients and optimizer states in host memory (FSDP2 CPU offload)"
                )


def _check_dapo(cfg: BallastConfig) -> None:
    fg, rm = cfg.algorithm.filter_groups, cfg.reward_model
    _one_of("reward_model.reward_manager", rm.reward_manager, get_args(RewardManagerName))
    if fg.enable and cfg.actor_rollout_ref.rollout.n < 2:
        raise ConfigError("algorithm.filter_groups.enable=True compares the answers of one prompt: "
                          f"actor_rollout_ref.rollout.n={cfg.actor_rollout_ref.rollout.n} must be >= 2")
    if fg.enable and fg.metric == "seq_final_reward" and cfg.algorithm.use_kl_in_reward:
        raise ConfigError("algorithm.filter_groups.metric=seq_final_reward with algorithm.use_kl_in_reward=True is "
                          "not supported (groups are filtered before the KL penalty): use metric=reward")
    gen = cfg.data.gen_batch_size
    if gen is not None and gen != cfg.data.train_batch_size and not fg.enable:
        raise ConfigError(f"data.gen_batch_size={gen} differs from data.train_batch_size={cfg.data.train_batch_size} "
                          "but algorithm.filter_groups.enable=False: every generated prompt would be trained on")
    if gen is not None and gen < 1:
        raise ConfigError(f"data.gen_batch_size={gen} must be >= 1 (or null)")
    ob = rm.overlong_buffer
    if ob.enable and not 0 < ob.len <= cfg.data.max_response_length:
        raise ConfigError(f"reward_model.overlong_buffer.len={ob.len} must be in (0, data.max_response_length="
                          f"{cfg.data.max_response_length}] when reward_model.overlong_buffer.enable=True")
    if ob.enable and rm.reward_manager != "dapo":
        raise ConfigError(f"reward_model.overlong_buffer.enable=True is applied by reward_model.reward_manager=dapo "
                          f"only (verl's {rm.reward_manager!r} manager ignores it): set reward_manager=dapo")


def _check_rules(cfg: BallastConfig) -> None:
    _check_offload(cfg)
    data, arr = cfg.data, cfg.actor_rollout_ref
    actor, rollout = arr.actor, arr.rollout
    seq = data.max_prompt_length + data.max_response_length
    if rollout.prompt_length < data.max_prompt_length or rollout.response_length < data.max_response_length:
        raise ConfigError(
            f"actor_rollout_ref.rollout.prompt_length={rollout.prompt_length} / response_length="
            f"{rollout.response_length} must cover data.max_prompt_length={data.max_prompt_length} / "
            f"data.max_response_length={data.max_response_length}"
        )
    if rollout.max_model_len is not None and rollout.max_model_len < seq:
        raise ConfigError(
            f"actor_rollout_ref.rollout.max_model_len={rollout.max_model_len} is smaller than "
            f"data.max_prompt_length + data.max_response_length = {seq}"
        )
    if rollout.max_num_batched_tokens < seq and not rollout.enable_chunked_prefill:
        raise ConfigError(
            f"actor_rollout_ref.rollout.max_num_batched_tokens={rollout.max_num_batched_tokens} is smaller than one "
            f"sample ({seq} tokens) and enable_chunked_prefill=False: vLLM could not schedule a full prompt"
        )
    if cfg.algorithm.adv_estimator == "gae" and cfg.critic.enable is False:
        raise ConfigError("algorithm.adv_estimator=gae needs a critic, but critic.enable=False")
    if cfg.critic.enable and cfg.algorithm.adv_estimator != "gae":
        raise ConfigError(
            f"critic.enable=True but algorithm.adv_estimator={cfg.algorithm.adv_estimator!r} does not use values"
        )
    if cfg.algorithm.adv_estimator in ("grpo", "rloo", "grpo_passk") and rollout.n < 2:
        raise ConfigError(
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares the samples of one prompt: "
            f"actor_rollout_ref.rollout.n={rollout.n} must be >= 2"
        )
    if cfg.trainer.critic_warmup > 0 and not uses_critic(cfg):
        raise ConfigError(f"trainer.critic_warmup={cfg.trainer.critic_warmup} needs a critic (algorithm.adv_estimator=gae)")
    _check_dapo(cfg)
    if cfg.trainer.val_only and not data.val_files:
        raise ConfigError("trainer.val_only=True needs data.val_files")
    _check_loader(cfg)


def _check_loader(cfg: BallastConfig) -> None:
    """The data loader's rules on its knobs, with the values `RunData` will pass it."""
    from ballast.data.loader import check_loader_knobs

    d = cfg.data
    try:
        check_loader_knobs(d.gen_batch_size or d.train_batch_size, d.dataloader_num_workers,
                           d.prefetch_factor if d.dataloader_num_workers > 0 else None, d.persistent_workers)
    except ValueError as err:
        raise ConfigError(str(err)) from None
