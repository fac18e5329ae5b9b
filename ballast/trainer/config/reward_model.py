"""The reward model's sizes from the config: where it runs, how its forward is cut, the longest
conversation it reads; refusals of what the config alone shows is wrong, each naming its key.

verl 0.9.1 reads no micro-batch or token-budget key for its reward model (it runs on an inference
server); Ballast runs the reward model's forward in its own engine, so those keys are Ballast's,
named as the critic's forward keys are. The checks that read the model's files are
`ballast.trainer.run.reward_model.check_reward_model`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ballast.trainer.config.errors import ConfigError

KEY = "reward.reward_model"
@dataclass(frozen=True)
class RewardModelSizes:
    """Where the reward model runs and how its forward is cut: `dp_size` ranks (its own pool's, or
    the trainer's), the micro-batch spec and the longest conversation it reads."""

    own_pool: bool
    dp_size: int
    micro: object  # ballast.engine.MicroBatchSpec
    max_length: int

    def policy(self):
        return self.micro.policy(1)


def reward_model_sizes(cfg, world_size: int, max_seq_len: int) -> Optional[RewardModelSizes]:
    """The reward model's sizes, or None when it is off; refuses what the config alone shows is wrong."""
    from ballast.engine import MicroBatchSpec
    from ballast.trainer.config.keys import build

    rm = cfg.reward.reward_model
    if not rm.enable:
        return None
    if not rm.model_path:
        raise ConfigError(f"{KEY}.enable=True needs {KEY}.model_path (a sequence-classifier directory)")
    if rm.enable_resource_pool and (rm.nnodes < 1 or rm.n_gpus_per_node < 1):
        raise ConfigError(f"{KEY}.enable_resource_pool=True needs {KEY}.nnodes >= 1 and {KEY}.n_gpus_per_node >= 1, "
                          f"got nnodes={rm.nnodes}, n_gpus_per_node={rm.n_gpus_per_node}")
    keys = {"micro_batch_size_per_gpu": f"{KEY}.micro_batch_size_per_gpu",
            "max_token_len_per_gpu": f"{KEY}.forward_max_token_len_per_gpu"}
    micro = build(keys, MicroBatchSpec, use_dynamic_bsz=rm.use_dynamic_bsz,
                  micro_batch_size_per_gpu=None if rm.use_dynamic_bsz else rm.micro_batch_size_per_gpu,
                  max_token_len_per_gpu=rm.forward_max_token_len_per_gpu if rm.use_dynamic_bsz else None)
    dp = rm.n_gpus_per_node * rm.nnodes if rm.enable_resource_pool else world_size
    positions = _max_positions(rm.model_path)
    max_length = rm.max_length if rm.max_length is not None else min(max_seq_len, positions - 1)
    if not 1 <= max_length <= positions - 1:
        raise ConfigError(f"{KEY}.max_length={max_length} must be in [1, {positions - 1}] (the reward model's "
                          f"max_position_embeddings={positions}, less one position for the score)")
    if micro.use_dynamic_bsz and micro.token_budget(1) < max_length + 1:
        raise ConfigError(f"{KEY}.forward_max_token_len_per_gpu={rm.forward_max_token_len_per_gpu} is smaller than "
                          f"one conversation of {KEY}.max_length={max_length} tokens plus one")
    return RewardModelSizes(rm.enable_resource_pool, dp, micro, max_length)


def _max_positions(model_path: str) -> int:
    import json
    import os

    try:
        with open(os.path.join(model_path, "config.json")) as f:
            config = json.load(f)
    except OSError as err:
        raise ConfigError(f"{KEY}.model_path={model_path!r}: cannot read config.json ({err})") from None
    return int(config.get("max_position_embeddings") or 1 << 20)
