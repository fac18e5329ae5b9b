"""Command-line entry point: `python -m ballast.trainer.main [hydra overrides]` (or `ballast-train`).

Hydra composes `configs/ppo_trainer.yaml` (or `--config-name quickstart`) with verl-style overrides;
the result is validated once into a frozen config plus derived sizes before anything starts.
`--cfg job` prints the composed config without running.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from ballast.trainer.config import ConfigError, ModelInfo, check_config, to_typed


def prepare(raw: DictConfig):
    """Typed config + derived sizes, or a `ConfigError` naming what is wrong."""
    cfg = to_typed(raw)
    model = ModelInfo.from_dir(cfg.actor_rollout_ref.model.path)
    return cfg, check_config(cfg, model)


@hydra.main(config_path="../configs", config_name="ppo_trainer", version_base=None)
def _hydra_main(raw: DictConfig) -> None:
    try:
        cfg, sizes = prepare(raw)
    except ConfigError as err:
        print(f"ballast: invalid config: {err}", file=sys.stderr)
        sys.exit(2)
    print(OmegaConf.to_yaml(raw, resolve=True))
    print("derived sizes:")
    for line in sizes.summary():
        print(f"  {line}")


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
