"""Command-line entry point: `python -m ballast.trainer.main [hydra overrides]` (or `ballast-train`).

Hydra composes `configs/ppo_trainer.yaml` (or `--config-name quickstart`) with verl-style overrides;
the result is validated once into a frozen config plus derived sizes before any worker starts.
`--cfg job` prints the composed config without running.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import sys
from typing import Optional

import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf

from ballast.trainer.config import BallastConfig, ConfigError, ModelInfo, check_config, to_typed


def absolute_paths(cfg: BallastConfig) -> BallastConfig:
    """The same config with every local path made absolute (Ray workers run in other directories)."""
    def absolute(path):
        return None if path is None else os.path.abspath(os.path.expanduser(path))

    arr = cfg.actor_rollout_ref
    model = dataclasses.replace(arr.model, path=absolute(arr.model.path), tokenizer_path=absolute(arr.model.tokenizer_path))
    critic_model = dataclasses.replace(cfg.critic.model, path=absolute(cfg.critic.model.path),
                                       tokenizer_path=absolute(cfg.critic.model.tokenizer_path))
    data = dataclasses.replace(cfg.data, train_files=[absolute(p) for p in cfg.data.train_files],
                               val_files=[absolute(p) for p in cfg.data.val_files] if cfg.data.val_files else None)
    trainer = dataclasses.replace(cfg.trainer, default_local_dir=absolute(cfg.trainer.default_local_dir))
    custom = cfg.custom_reward_function
    custom = dataclasses.replace(custom, path=absolute(custom.path))
    return dataclasses.replace(cfg, data=data, actor_rollout_ref=dataclasses.replace(arr, model=model),
                               critic=dataclasses.replace(cfg.critic, model=critic_model), trainer=trainer,
                               custom_reward_function=custom)


def prepare(raw: DictConfig):
    """Typed config (absolute paths) + derived sizes, or a `ConfigError` naming what is wrong."""
    return prepare_typed(to_typed(raw))


def prepare_typed(cfg: BallastConfig):
    cfg = absolute_paths(cfg)
    model = ModelInfo.from_dir(cfg.actor_rollout_ref.model.path)
    sizes = check_config(cfg, model)
    if cfg.actor_rollout_ref.rollout.name == "vllm":
        try:
            import vllm  # noqa: F401
        except Exception as err:  # an absent or broken install: both are start-up errors
            raise ConfigError(
                f"actor_rollout_ref.rollout.name=vllm but vllm cannot be imported ({type(err).__name__}: {err}); "
                "run scripts/setup.sh or use actor_rollout_ref.rollout.name=hf"
            ) from err
    return cfg, sizes


@contextlib.contextmanager
def training_session(cfg: BallastConfig, sizes, raw_config: Optional[dict] = None):
    """Data, Ray, workers and trackers for one run; yields the `RayPPOTrainer` and cleans up after."""
    import json

    import ray
    import torch
    from tqdm import tqdm

    from ballast.models import load_tokenizer
    from ballast.trainer.data_setup import RunData
    from ballast.trainer.ray_trainer import RayPPOTrainer
    from ballast.trainer.reward import RewardManager
    from ballast.trainer.roles import create_workers
    from ballast.trainer.tracking import Tracker

    seed = cfg.trainer.seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    arr = cfg.actor_rollout_ref
    tokenizer = load_tokenizer(arr.model.tokenizer_path or arr.model.path)
    data = RunData(cfg, tokenizer)
    reward = RewardManager.from_config(tokenizer, cfg.custom_reward_function.path, cfg.custom_reward_function.name,
                                       cfg.data.reward_fn_key)
    owns_ray = start_ray(cfg)
    workers = None
    tracker = Tracker(cfg.trainer.logger, cfg.trainer.project_name, cfg.trainer.experiment_name,
                      cfg.trainer.default_local_dir, config=raw_config, console=tqdm.write)
    try:
        print("ballast: derived sizes\n  " + "\n  ".join(sizes.summary()), flush=True)
        workers = create_workers(cfg, sizes, data.total_steps)
        with open(os.path.join(arr.model.path, "config.json")) as f:
            model_config = json.load(f)
        yield RayPPOTrainer(cfg, sizes, data, workers, reward, tracker, model_config)
    finally:
        tracker.finish()
        if workers is not None:
            workers.shutdown()
        if owns_ray:
            ray.shutdown()


def run(cfg: BallastConfig, sizes, raw_config: Optional[dict] = None) -> dict:
    """Train; returns the last step's metrics."""
    with training_session(cfg, sizes, raw_config) as trainer:
        return trainer.fit()


def start_ray(cfg: BallastConfig) -> bool:
    """Connect to `ray_init.address` or start a local instance; True if this call started Ray."""
    import tempfile

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return False
    r = cfg.ray_init
    if r.address:
        ray.init(address=r.address, log_to_driver=True)
        return True
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    num_cpus = r.num_cpus or max(os.cpu_count() or 1, world)
    ray.init(num_cpus=num_cpus, include_dashboard=False, dashboard_host=r.dashboard_host,
             _temp_dir=tempfile.mkdtemp(prefix="ray_", dir="/tmp"))
    return True


@hydra.main(config_path="../configs", config_name="ppo_trainer", version_base=None)
def _hydra_main(raw: DictConfig) -> None:
    try:
        cfg, sizes = prepare(raw)
    except ConfigError as err:
        print(f"ballast: invalid config: {err}", file=sys.stderr)
        sys.exit(2)
    run(cfg, sizes, OmegaConf.to_container(raw, resolve=True))


def main() -> None:
    _hydra_main()


if __name__ == "__main__":
    main()
