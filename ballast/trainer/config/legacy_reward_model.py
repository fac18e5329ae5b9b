"""verl's legacy reward-model keys: a set `reward_model.enable` / `enable_resource_pool` /
`n_gpus_per_node` / `nnodes` / `model.path` moves to `reward.reward_model.*` before the config is
typed, the legacy value winning, as verl 0.9.1 migrates them."""

from __future__ import annotations

LEGACY_KEYS = ("enable", "enable_resource_pool", "n_gpus_per_node", "nnodes")


def migrate_legacy_keys(plain: dict) -> None:
    """Move verl's set legacy `reward_model.*` keys into `reward.reward_model` (in place, before typing)."""
    legacy, new = plain.get("reward_model"), plain.get("reward", {}).get("reward_model")
    if not isinstance(legacy, dict) or not isinstance(new, dict):
        return
    for key in LEGACY_KEYS:
        if legacy.get(key) is not None:
            new[key] = legacy[key]
    path = (legacy.get("model") or {}).get("path")
    if path is not None:
        new["model_path"] = path
