"""Typed config (schema + loader), start-up validation and the frozen derived batch sizes."""

from ballast.trainer.config.derived import DerivedSizes, RoleSizes, derive_sizes, uses_critic, uses_reference
from ballast.trainer.config.loader import CONFIG_DIR, ConfigError, compose, load_config, to_typed
from ballast.trainer.config.model_info import ModelInfo
from ballast.trainer.config.schema import BallastConfig
from ballast.trainer.config.validate import check_config

__all__ = [
    "BallastConfig", "CONFIG_DIR", "ConfigError", "DerivedSizes", "ModelInfo", "RoleSizes",
    "check_config", "compose", "derive_sizes", "load_config", "to_typed", "uses_critic", "uses_reference",
]
