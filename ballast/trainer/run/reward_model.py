"""Wiring the reward model into a run: its worker spec and sizes from the config and the start-up
checks that read its files (before Ray starts),
its worker group (once, resident for the whole run: on a pool of its own with
`reward.reward_model.enable_resource_pool`, else beside the trainer's groups on their pool), and the
reward the trainer calls (`ballast.trainer.step.reward_model.CombinedReward`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Tuple

from ballast.engine import EngineConfig
from ballast.trainer.config.errors import ConfigError
from ballast.trainer.config.keys import build
from ballast.trainer.config.reward_model import KEY, RewardModelSizes, reward_model_sizes
from ballast.workers.reward_model import RewardModelSpec


@dataclass(frozen=True)
class RewardModelRun:
    """The reward model's sizes and worker spec."""

    sizes: RewardModelSizes
    spec: RewardModelSpec


def reward_model_run(cfg, world_size: int, max_seq_len: int) -> Optional[RewardModelRun]:
    """None when `reward.reward_model.enable` is off; refusals name their key."""
    sizes = reward_model_sizes(cfg, world_size, max_seq_len)
    if sizes is None:
        return None
    rm = cfg.reward.reward_model
    keys = {"device": "trainer.device", "model_path": f"{KEY}.model_path",
            "use_remove_padding": f"{KEY}.use_remove_padding"}
    engine = build(keys, EngineConfig, model_path=os.path.abspath(rm.model_path), role="reward",
                   use_remove_padding=rm.use_remove_padding, device=cfg.trainer.device, grad_clip=None)
    return RewardModelRun(sizes, RewardModelSpec(engine, seed=cfg.trainer.seed,
                                                 dist_timeout_s=cfg.trainer.worker_timeout_s))


def create_group(cfg, run: RewardModelRun, trainer_pool, share: float, use_gpu: bool, **group_kwargs) -> Tuple:
    """(the reward model's worker group, its own pool or None), its model loaded."""
    from ballast.single_controller import RayWorkerGroup, ResourcePool
    from ballast.workers.reward_model import RewardModelWorker

    pool = None
    if run.sizes.own_pool:
        rm, t = cfg.reward.reward_model, cfg.trainer
        pool = ResourcePool([rm.n_gpus_per_node] * rm.nnodes, use_gpu=use_gpu, cpus_per_process=float(t.cpus_per_worker),
                            name=f"ballast_rm_{os.getpid()}", ready_timeout_s=cfg.ray_init.timeout_s)
    try:
        group = RayWorkerGroup(pool or trainer_pool, RewardModelWorker, init_args=(run.spec,), name="reward_model",
                               device_share=1.0 if pool is not None else share, **group_kwargs)
        return group, pool
    except BaseException:
        if pool is not None:
            pool.remove()
        raise


def combined_reward(cfg, rule_reward, policy_tokenizer, rm_tokenizer, run: RewardModelRun, group):
    """The trainer's reward: the rule reward and the reward model's score, combined."""
    import json

    from ballast.balance import FlopsModel
    from ballast.trainer.step.reward_model import CombinedReward, RewardModelScorer, RmInputs

    rm = cfg.reward.reward_model
    inputs = RmInputs(policy_tokenizer, rm_tokenizer, run.sizes.max_length)
    workload = cfg.trainer.balance_workload
    if workload == "flops":  # the reward model's own shape
        with open(os.path.join(run.spec.engine.model_path, "config.json")) as f:
            workload = FlopsModel.from_hf_config(json.load(f))
    scorer = RewardModelScorer(inputs, group, run.sizes.dp_size, run.sizes.policy(), cfg.trainer.balance_batch,
                               workload)
    return CombinedReward(rule_reward, scorer, rm.score_weight, rm.rule_weight)


def check_reward_model(cfg, sizes: RewardModelSizes, policy_tokenizer) -> object:
    """The start-up checks that read the reward model's files (module docstring); returns its tokenizer."""
    from ballast.engine.model import reward_model_problem
    from ballast.models import load_tokenizer
    from ballast.trainer.step.reward_model import render_conversation, same_text_format

    path = cfg.reward.reward_model.model_path
    problem = reward_model_problem(path)
    if problem is not None:
        raise ConfigError(f"{KEY}.model_path: {problem}")
    try:
        tokenizer = load_tokenizer(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{KEY}.model_path={path!r}: no usable tokenizer ({err})") from None
    if same_text_format(policy_tokenizer, tokenizer):
        longest = cfg.data.max_prompt_length + cfg.data.max_response_length
        if longest > sizes.max_length:
            raise ConfigError(f"{KEY}.max_length={sizes.max_length} is shorter than the longest conversation, "
                              f"data.max_prompt_length + data.max_response_length = {longest}")
        return tokenizer
    try:
        probe = render_conversation(tokenizer, [{"role": "user", "content": "x"}], "y")
    except Exception as err:  # a template that does not render is a config error, not a crash mid-run
        raise ConfigError(f"{KEY}.model_path={path!r}: its chat template fails on a two-message chat "
                          f"({type(err).__name__}: {err})") from None
    if not tokenizer(probe, add_special_tokens=False)["input_ids"]:
        raise ConfigError(f"{KEY}.model_path={path!r}: its chat template renders a two-message chat as no tokens")
    return tokenizer
