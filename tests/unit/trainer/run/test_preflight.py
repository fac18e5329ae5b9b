"""Checks the command line makes before Ray starts: model weight files (a truncated safetensors is
exit 2 naming the file)."""

import os

import pytest


def test_prepare_rejects_a_truncated_model_before_ray_with_exit_2(model_copy):
    from ballast.trainer.config import load_config
    from ballast.trainer.main import EXIT_BAD_INPUT, InputError, failure, prepare_typed

    path = model_copy / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    cfg = load_config([f"actor_rollout_ref.model.path={model_copy}", "data.train_files=/t.parquet",
                       "trainer.device=cpu", "trainer.n_gpus_per_node=2", "data.max_prompt_length=32",
                       "data.max_response_length=24", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.name=hf",
                       "actor_rollout_ref.actor.use_dynamic_bsz=True", "algorithm.adv_estimator=grpo"])
    with pytest.raises(InputError, match=rf"actor_rollout_ref\.model\.path: model file '{path}' .* truncated") as info:
        prepare_typed(cfg)
    assert failure(info.value)[0] == EXIT_BAD_INPUT
