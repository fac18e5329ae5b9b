"""Start-up rules on the config that neither its schema nor the sizes and specs built from it express.

Everything here runs on the driver before any Ray actor exists, so an invalid config never reaches a
worker. Each rule is stated once, by its owner: a value outside a field's choices is refused by the
loader (the schema types it); batch divisibility lives with the sizes it protects (`derived.py`);
FSDP sections with their resolution (`fsdp.py`); what the engine, rollout and data loader require of
their own settings is checked by them when `ballast.trainer.run.run_plan.plan_run` builds their specs,
and reported with the config key (`keys.py`); registered names (advantage estimators, losses,
loggers) by `plan_run` against the registries. What is left here are rules about keys only the
trainer reads; `check_rules` runs them all.
"""

from __future__ import annotations

import os
import re
from typing import Iterable

from ballast.trainer.config.derived import uses_critic
from ballast.trainer.config.fsdp import check_fsdp
from ballast.trainer.config.loader import ConfigError
from ballast.trainer.config.off_policy import check_off_policy
from ballast.trainer.config.schema import BallastConfig, OptimSection, ResumeMode
from ballast.trainer.config.schema.choice import values

# `flops` is a FlopsModel built from the actor's HF config; the named workloads are balance's.
BALANCE_WORKLOADS = ("flops",)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_rules(cfg: BallastConfig) -> None:
    """Raise `ConfigError`, naming the keys, for the first rule `cfg` breaks."""
    _check_choices(cfg)
    _check_ranges(cfg)
    _check_rules(cfg)


def one_of(key: str, value, allowed: Iterable) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(repr, allowed))}")


def _at_least(key: str, value, low, inclusive: bool = True) -> None:
    if value is None or (value < low if inclusive else value <= low):
        raise ConfigError(f"{key}={value!r} must be {'>=' if inclusive else '>'} {low}")


def _in_unit(key: str, value: float, allow_zero: bool = False) -> None:
    if not ((0.0 <= value if allow_zero else 0.0 < value) and value <= 1.0):
        raise ConfigError(f"{key}={value!r} must be in {'[0' if allow_zero else '(0'}, 1]")


def _check_choices(cfg: BallastConfig) -> None:
    """Values the schema lets through (verl's, or any string) that Ballast does not run."""
    from ballast.balance.workload import WORKLOAD_NAMES
    from ballast.engine.config import LR_SCHEDULES

    arr, actor, t = cfg.actor_rollout_ref, cfg.actor_rollout_ref.actor, cfg.trainer
    for key, strategy in (("actor_rollout_ref.actor.strategy", actor.strategy), ("critic.strategy", cfg.critic.strategy)):
        if strategy == "fsdp":
            raise ConfigError(
                f"{key}='fsdp' is verl's FSDP1 wrapper, which Ballast does not implement; Ballast's engine is "
                f"FSDP2: set {key}=fsdp2 (the same sharded data-parallel training)"
            )
    for prefix, optim in (("actor_rollout_ref.actor.optim", actor.optim), ("critic.optim", cfg.critic.optim)):
        if optim.warmup_style is not None:
            # warmup_style overrides it, so the engine never sees (and checks) this one.
            one_of(f"{prefix}.lr_scheduler_type", optim.lr_scheduler_type, LR_SCHEDULES)
    one_of("trainer.balance_workload", t.balance_workload, WORKLOAD_NAMES + BALANCE_WORKLOADS)
    modes = values(ResumeMode)
    if t.resume_mode not in modes and not os.path.isdir(os.path.expanduser(t.resume_mode)):
        raise ConfigError(
            f"trainer.resume_mode={t.resume_mode!r} is not one of {', '.join(map(repr, modes))} "
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
        ("trainer.cpus_per_worker", t.cpus_per_worker),
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
    recovery = t.ballast_rollout_recovery
    _at_least("trainer.ballast_rollout_recovery.max_restarts", recovery.max_restarts, 0)
    _at_least("trainer.ballast_rollout_recovery.health_check_timeout_s", recovery.health_check_timeout_s, 0.0,
              inclusive=False)
    if recovery.generate_timeout_s is not None:
        _at_least("trainer.ballast_rollout_recovery.generate_timeout_s", recovery.generate_timeout_s, 0.0,
                  inclusive=False)
    if cfg.reward.timeout_s is not None:
        _at_least("reward.timeout_s", cfg.reward.timeout_s, 0.0, inclusive=False)
    _at_least("ray_init.timeout_s", cfg.ray_init.timeout_s, 0.0, inclusive=False)
    for i, name in enumerate(cfg.ray_init.worker_env_vars):
        if not (isinstance(name, str) and _ENV_NAME.fullmatch(name)):
            raise ConfigError(f"ray_init.worker_env_vars[{i}]={name!r} is not an environment variable name")
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


def _check_dapo(cfg: BallastConfig) -> None:
    fg, rm = cfg.algorithm.filter_groups, cfg.reward_model
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
    check_fsdp(cfg)
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
    check_off_policy(cfg)
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
