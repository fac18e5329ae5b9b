"""Frozen engine and rollout specs built from config values, their errors named by config key.

The engine, rollout and data layers own the rules about their specs and settings and raise an error
naming the field (`SpecError`; the data layer's `SettingError`); only the trainer knows which config
key fed that field. `build` re-raises such an error as a
`ConfigError` that starts with the key, so each rule is stated once, by the layer that owns it, and
is still reported in the terms of the config the user wrote.
"""

from __future__ import annotations

from typing import Callable, Mapping, TypeVar

from ballast.trainer.config.loader import ConfigError

T = TypeVar("T")


def build(keys: Mapping[str, str], make: Callable[..., T], *args, **kwargs) -> T:
    """`make(*args, **kwargs)`, with a `SpecError` about field f re-raised as `ConfigError("<keys[f]>: ...")`.

    A field missing from `keys` is not fed by the config (a builder bug, not a bad config): its error
    passes through unchanged.
    """
    try:
        return make(*args, **kwargs)
    except ValueError as err:
        # The error is matched by its `field` rather than its class: importing `ballast.engine` loads
        # torch and transformers, and the config package stays quick to import without them.
        field = getattr(err, "field", None)
        if field not in keys:
            raise
        raise ConfigError(f"{keys[field]}: {err}") from None
