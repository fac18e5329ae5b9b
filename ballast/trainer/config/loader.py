"""Loading the config: hydra composition, the typed schema, and errors that name the key.

`load_config(overrides)` is what tests and tools use; the hydra entry point hands its DictConfig to
`to_typed`. Both end in a frozen `BallastConfig`; nothing downstream sees a DictConfig.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from pathlib import Path
from typing import Iterable, Optional

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ballast.trainer.config.errors import ConfigError  # noqa: F401 (the loader's error, re-exported)
from ballast.trainer.config.off_policy import prepare_off_policy
from ballast.trainer.config.overrides import ambiguous_overrides
from ballast.trainer.config.legacy_reward_model import migrate_legacy_keys
from ballast.trainer.config.schema import BallastConfig, Choice
from ballast.trainer.config.schema.choice import values

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def load_config(overrides: Iterable[str] = (), config_name: str = "ppo_trainer") -> BallastConfig:
    """Compose `configs/<config_name>.yaml` with hydra-style overrides and return the typed config."""
    return to_typed(compose(overrides, config_name))


def compose(overrides: Iterable[str] = (), config_name: str = "ppo_trainer") -> DictConfig:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException

    _refuse_ambiguous(overrides)
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            return hydra_compose(config_name=config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(f"invalid override: {err}") from err


def _as_path_list(value) -> Optional[list]:
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        return [str(value)]
    if isinstance(value, (list, tuple, ListConfig)):
        return [str(v) for v in value]
    raise ConfigError(f"data files must be a path or a list of paths, got {value!r}")


def to_typed(cfg: DictConfig) -> BallastConfig:
    """Check `cfg` against the schema (unknown keys, wrong types, missing values) and freeze it."""
    _refuse_ambiguous(_command_line_overrides())
    try:
        plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as err:
        raise ConfigError(_describe(err)) from err
    plain.pop("hydra", None)
    for line in prepare_off_policy(plain):
        print(line, flush=True)
    migrate_legacy_keys(plain)
    data = plain.get("data", {})
    if isinstance(data, dict):
        for key in ("train_files", "val_files"):
            if key in data:
                try:
                    data[key] = _as_path_list(data[key])
                except ConfigError as err:
                    raise ConfigError(f"data.{key}: {err}") from None
    try:
        typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(_mutable_twin(BallastConfig)), plain))
    except OmegaConfBaseException as err:
        raise ConfigError(_describe(err)) from err
    return _freeze(typed, BallastConfig)


def _refuse_ambiguous(overrides) -> None:
    messages = ambiguous_overrides(overrides)
    if messages:
        raise ConfigError(messages[0])


def _command_line_overrides() -> list:
    """The overrides of the running `@hydra.main` command line (none outside one)."""
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def _section(tp) -> Optional[type]:
    """The schema dataclass a field holds (`Section` or `Optional[Section]`), None for a plain value."""
    if dataclasses.is_dataclass(tp):
        return tp
    return next((arg for arg in typing.get_args(tp) if dataclasses.is_dataclass(arg)), None)


@functools.lru_cache(maxsize=None)
def _mutable_twin(cls: type) -> type:
    """A non-frozen copy of a schema dataclass (recursively): OmegaConf marks frozen dataclasses
    read-only, which would make it refuse to fill the schema with the yaml's values."""
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        tp, section = hints[f.name], _section(hints[f.name])
        if section is not None:
            tp = _mutable_twin(section) if tp is section else Optional[_mutable_twin(section)]
        fields.append((f.name, tp))
    return dataclasses.make_dataclass(cls.__name__, fields)


def _freeze(value, cls: type):
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        item, section = getattr(value, f.name), _section(hints[f.name])
        kwargs[f.name] = _freeze(item, section) if section is not None and item is not None else item
    return cls(**kwargs)


def _describe(err: OmegaConfBaseException) -> str:
    key = getattr(err, "full_key", None)
    text = str(err).splitlines()[0]
    if "Missing mandatory value" in text and key:
        return f"{key} must be set (it has no default), e.g. {key}=..."
    kind = _field_type(key) if key else None
    if isinstance(kind, type) and issubclass(kind, Choice):
        return f"{key}={getattr(err, 'value', None)!r} is not one of {', '.join(map(repr, values(kind)))}"
    return f"{key}: {text}" if key else text


def _field_type(key: str):
    """The schema's type of the dotted `key` (Optional unwrapped), or None when the schema has no such key."""
    kind = BallastConfig
    for part in key.split("."):
        if not dataclasses.is_dataclass(kind):
            return None
        kind = typing.get_type_hints(kind).get(part)
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        if typing.get_origin(kind) is typing.Union and len(args) == 1:
            kind = args[0]
    return kind
