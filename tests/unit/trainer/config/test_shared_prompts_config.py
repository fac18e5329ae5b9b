"""`actor_rollout_ref.actor.use_prefix_grouper`: what running each prompt once needs is checked at
start-up, naming the key and the numbers."""

import pytest

from ballast.trainer.config import ConfigError, derive_sizes, load_config

BASE = ["data.train_files=/data/train.parquet", "actor_rollout_ref.model.path=/models/tiny",
        "trainer.n_gpus_per_node=2", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=160", "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=true",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=160", "data.max_prompt_length=16",
        "data.max_response_length=32", "actor_rollout_ref.actor.use_prefix_grouper=true", "algorithm.adv_estimator=grpo"]


def _sizes(*overrides):
    return derive_sizes(load_config(BASE + list(overrides)))


def test_a_config_that_fits_whole_prompts_is_accepted():
    assert _sizes().actor.dp_size == 2


@pytest.mark.parametrize("override,fragment", [
    ("actor_rollout_ref.model.use_remove_padding=false", "actor_rollout_ref.model.use_remove_padding=True"),
    ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "ulysses_sequence_parallel_size=2 must be 1"),
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu=128",
     "ppo_max_token_len_per_gpu=128 is smaller than a whole group, data.max_prompt_length + rollout.n * "
     "data.max_response_length = 16 + 4 * 32 = 144"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.actor.ppo_mini_batch_size=1 is not divisible"),
])
def test_what_sharing_prompts_cannot_run_is_refused_naming_the_key(override, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("+", r"\+").replace("*", r"\*").replace("(", r"\(")):
        _sizes(override)


def test_static_micro_batches_must_hold_whole_prompts():
    static = ["actor_rollout_ref.actor.use_dynamic_bsz=false", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"]
    with pytest.raises(ConfigError, match="ppo_micro_batch_size_per_gpu=2 must be a multiple of actor_rollout_ref.rollout.n=4"):
        _sizes(*static[:1], "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2")
    assert _sizes(static[0], "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8").actor.grad_accum_steps == 1
