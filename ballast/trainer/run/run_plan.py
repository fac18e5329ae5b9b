"""The run's plan: the config checked, its sizes derived and every worker spec built, once.

`plan_run` is the start-up check. It runs on the driver before Ray starts, after the data has been
read (the optimizer's schedule spans the run's step count, which the data decides), and raises the
first `ConfigError` it meets, naming the keys: the config's own rules (`config.validate`), names
looked up in the registries (here: the registries live above the config package), the batch
divisibility of the derived sizes, and whatever the engine, rollout and loss specs refuse while
`builders` makes them. What it returns is what the workers are constructed from; nothing is built
a second time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ballast.trainer.algorithms import registered_names
from ballast.trainer.algorithms.kl import make_kl_controller
from ballast.trainer.run.builders import WorkerSpecs, worker_specs
from ballast.trainer.config import BallastConfig, ConfigError, DerivedSizes, ModelInfo, check_rules, derive_sizes
from ballast.trainer.config.validate import one_of
from ballast.trainer.step.old_log_probs import OldLogProbSource, old_log_prob_source
from ballast.trainer.run.tracking import LOGGERS


@dataclass(frozen=True)
class RunPlan:
    """Sizes, old-log-prob source and worker specs of one run, for `total_steps` training steps."""

    sizes: DerivedSizes
    specs: WorkerSpecs
    total_steps: int
    old_log_probs: OldLogProbSource  # where the old policy's log-probs come from; owns the rollout correction


def plan_run(cfg: BallastConfig, model: Optional[ModelInfo], total_steps: int) -> RunPlan:
    """Check `cfg` (and its fit to `model`, when known) and build the run's sizes and specs."""
    _check_registered_names(cfg)
    check_rules(cfg)
    # The caller counts the steps from keys `check_rules` has just checked (total_epochs, total_training_steps).
    assert total_steps >= 1, f"total_steps={total_steps}"
    sizes = derive_sizes(cfg, model)
    source = old_log_prob_source(cfg, sizes)  # the one parse of algorithm.rollout_correction
    return RunPlan(sizes=sizes, specs=worker_specs(cfg, sizes, total_steps, source), total_steps=total_steps,
                   old_log_probs=source)


def _check_registered_names(cfg: BallastConfig) -> None:
    """Names that must be in a registry: advantage estimators, losses, KL estimators and loggers."""
    names = registered_names()
    actor = cfg.actor_rollout_ref.actor
    one_of("algorithm.adv_estimator", cfg.algorithm.adv_estimator, names["adv_estimator"])
    one_of("actor_rollout_ref.actor.policy_loss.loss_mode", actor.policy_loss.loss_mode, names["policy_loss"])
    one_of("actor_rollout_ref.actor.kl_loss_type", actor.kl_loss_type, names["kl_penalty"])
    one_of("algorithm.kl_penalty", cfg.algorithm.kl_penalty, names["kl_penalty"])
    kl = cfg.algorithm.kl_ctrl
    try:  # the controller checks its own settings, naming the keys
        make_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    for i, name in enumerate(cfg.trainer.logger):
        one_of(f"trainer.logger[{i}]", name, LOGGERS)
