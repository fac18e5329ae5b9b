"""Typed config (schema + loader), the start-up rules on it and the frozen derived batch sizes.

This package imports no other part of `ballast.trainer`: `ballast.trainer.run.run_plan.plan_run` builds
a run's sizes and worker specs from it, once, and is the start-up check.
"""

from ballast.trainer.config.derived import (DerivedSizes, RoleSizes, actor_uses_lora, derive_sizes, uses_critic,
                                            uses_reference)
from ballast.trainer.config.fsdp import role_fsdp, role_precision
from ballast.trainer.config.loader import CONFIG_DIR, ConfigError, compose, load_config, to_typed
from ballast.trainer.config.model_info import ModelInfo
from ballast.trainer.config.schema import BallastConfig
from ballast.trainer.config.validate import check_rules

__all__ = [
    "BallastConfig", "CONFIG_DIR", "ConfigError", "DerivedSizes", "ModelInfo", "RoleSizes", "actor_uses_lora",
    "check_rules", "compose", "derive_sizes", "load_config", "role_fsdp", "role_precision", "to_typed", "uses_critic",
    "uses_reference",
]
