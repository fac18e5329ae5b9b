"""verl's key names and switches: each is accepted and means what verl means, or stops the run at
start-up with an error naming the key."""

import pytest

from ballast.trainer.run.builders import actor_loss_config, engine_optim
from ballast.trainer.config import ConfigError, ModelInfo, load_config
from ballast.trainer.run.run_plan import plan_run

TINY = ModelInfo(4, 2, 128, 2, 256, 512, 2048)
BASE = ["data.train_files=/d.parquet", "actor_rollout_ref.model.path=/m", "trainer.n_gpus_per_node=2",
        "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048",
        "data.max_prompt_length=128", "data.max_response_length=256", "algorithm.adv_estimator=grpo"]


def _checked(*overrides, device="cpu"):
    """(config, its plan for 10 steps)."""
    cfg = load_config(BASE + [f"trainer.device={device}"] + list(overrides))
    return cfg, plan_run(cfg, TINY, total_steps=10)


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.fsdp_config.param_offload",
                                 "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
                                 "actor_rollout_ref.actor.fsdp_config.offload_policy",
                                 "actor_rollout_ref.ref.fsdp_config.param_offload",
                                 "critic.fsdp_config.offload_policy"])
def test_offload_on_a_cpu_device_fails_at_start_up_naming_the_key(key):
    with pytest.raises(ConfigError, match=f"{key}=True .* trainer.device=cpu"):
        _checked(f"{key}=True")


@pytest.mark.parametrize("key", ["actor_rollout_ref.actor.fsdp_config.param_offload",
                                 "actor_rollout_ref.actor.fsdp_config.optimizer_offload",
                                 "critic.fsdp_config.optimizer_offload"])
def test_between_phase_offload_is_rejected_not_merged(key):
    with pytest.raises(ConfigError, match=f"{key}=True .* not implemented"):
        _checked(f"{key}=True", device="cuda")


def test_offload_policy_and_ref_param_offload_mean_fsdp2_cpu_offload():
    _, plan = _checked("actor_rollout_ref.ref.fsdp_config.param_offload=True", "actor_rollout_ref.actor.use_kl_loss=True",
                       device="cuda")
    spec = plan.specs.actor_rollout_ref
    assert spec.ref.cpu_offload is True and spec.actor.cpu_offload is False
    _, plan = _checked("actor_rollout_ref.actor.fsdp_config.offload_policy=True", device="cuda")
    assert plan.specs.actor_rollout_ref.actor.cpu_offload is True


def test_fsdp_size_is_hybrid_sharding_and_the_reference_model_follows_the_actor():
    _, plan = _checked("actor_rollout_ref.actor.fsdp_config.fsdp_size=1", "actor_rollout_ref.actor.use_kl_loss=True")
    spec = plan.specs.actor_rollout_ref
    assert spec.actor.fsdp_size == 1 and spec.ref.fsdp_size == 1  # verl: one mesh per worker, from the actor's
    _, plan = _checked("critic.fsdp_config.fsdp_size=2", "algorithm.adv_estimator=gae")
    assert plan.specs.critic.critic.fsdp_size == 2
    assert plan.specs.actor_rollout_ref.actor.fsdp_size == -1
    _checked("actor_rollout_ref.actor.fsdp_config.fsdp_size=8")  # >= the worker count: shard over all, as verl


def test_one_fsdp_section_type_in_four_places_with_inheritance():
    # critic.model.fsdp_config (verl's older spelling): a field set there overrides critic.fsdp_config.
    _, plan = _checked("algorithm.adv_estimator=gae", "critic.model.fsdp_config.offload_policy=True",
                       "critic.model.fsdp_config.reshard_after_forward=False", "critic.fsdp_config.fsdp_size=2",
                       device="cuda")
    critic = plan.specs.critic.critic
    assert (critic.cpu_offload, critic.reshard_after_forward, critic.fsdp_size) == (True, False, 2)
    # The reference model: its own offload and resharding, the actor's mesh (its null fsdp_size).
    _, plan = _checked("actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.fsdp_config.fsdp_size=1",
                       "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=False")
    ref = plan.specs.actor_rollout_ref.ref
    assert (ref.fsdp_size, ref.reshard_after_forward, ref.cpu_offload) == (1, True, False)
    _checked("actor_rollout_ref.ref.fsdp_config.fsdp_size=1", "actor_rollout_ref.actor.fsdp_config.fsdp_size=1")


@pytest.mark.parametrize("overrides, fragment", [
    (["actor_rollout_ref.ref.fsdp_config.fsdp_size=1"],
     "actor_rollout_ref.ref.fsdp_config.fsdp_size=1 differs from actor_rollout_ref.actor.fsdp_config.fsdp_size=-1"),
    (["actor_rollout_ref.actor.fsdp_config.reshard_after_forward=null"],
     "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=null: set a value"),
    (["critic.fsdp_config.fsdp_size=null"], "critic.fsdp_config.fsdp_size=null: set a value"),
    (["actor_rollout_ref.ref.fsdp_config.optimizer_offload=True"],
     "actor_rollout_ref.ref.fsdp_config.optimizer_offload=True .* not implemented"),
    (["critic.model.fsdp_config.fsdp_size=3", "trainer.n_gpus_per_node=4"],
     "critic.model.fsdp_config.fsdp_size=3: must be -1"),
])
def test_fsdp_sections_that_cannot_run_fail_at_start_up(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        _checked(*overrides, device="cuda")


@pytest.mark.parametrize("key, value", [("actor_rollout_ref.actor.fsdp_config.fsdp_size", 3),
                                        ("actor_rollout_ref.actor.fsdp_config.fsdp_size", 0),
                                        ("critic.fsdp_config.fsdp_size", -2)])
def test_fsdp_size_that_does_not_divide_the_workers_fails_at_start_up(key, value):
    with pytest.raises(ConfigError, match=f"{key}={value}: must be -1 .* divides the 4 workers"):
        _checked(f"{key}={value}", "trainer.n_gpus_per_node=4")


@pytest.mark.parametrize("overrides, fragment", [
    (["actor_rollout_ref.actor.strategy=fsdp"], "actor.strategy='fsdp' is verl's FSDP1"),
    (["critic.strategy=fsdp"], "critic.strategy='fsdp' is verl's FSDP1"),
    (["actor_rollout_ref.actor.strategy=megatron"], "actor.strategy='megatron' is not one of"),
    (["actor_rollout_ref.hybrid_engine=False"], "hybrid_engine=False with trainer.v1.trainer_mode=sync"),
    (["actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=top"],
     "multi_turn.tool_response_truncate_side: .*must be one of"),
    (["actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.multi_turn.tool_config_path=/nonexistent.yaml"],
     "multi_turn.tool_config_path: .*is not a file"),
    (["actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.agent.default_agent_loop=mystery"],
     "agent.default_agent_loop='mystery' is not an agent loop"),
    (["actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=0"],
     "multi_turn.max_assistant_turns: .*must be null or an int >= 1"),
    (["actor_rollout_ref.actor.optim.lr_scheduler_type=linear"], "optim.lr_scheduler_type: optim.lr_schedule must be one of .*, got 'linear'"),
    (["trainer.val_only=True"], "val_only=True needs data.val_files"),
    (["actor_rollout_ref.rollout.val_kwargs.n=4"], "val_kwargs.n=4 with val_kwargs.do_sample=False"),
    (["algorithm.filter_groups.enable=True", "actor_rollout_ref.rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus"],
     "filter_groups.enable=True .*rollout.n=1 must be >= 2"),
    (["reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=512"],
     "overlong_buffer.len=512 must be in \\(0, data.max_response_length=256\\]"),
    (["reward_model.reward_manager=prime"], "reward_model.reward_manager='prime' is not one of"),
    (["reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=64"],
     "overlong_buffer.enable=True is applied by reward_model.reward_manager=dapo only"),
    (["data.gen_batch_size=12"], "data.gen_batch_size=12 differs from data.train_batch_size=8 but algorithm.filter_groups"),
    (["data.gen_batch_size=3", "algorithm.filter_groups.enable=True", "actor_rollout_ref.rollout.n=1",
      "actor_rollout_ref.rollout.n=3"], "gen_batch_size \\* actor_rollout_ref.rollout.n = 9 samples must divide"),
])
def test_unsupported_verl_values_are_start_up_errors(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment):
        _checked(*overrides)


def test_scheduler_type_spellings_and_warmup_fallback_as_verl():
    cfg, _ = _checked("actor_rollout_ref.actor.optim.lr_scheduler_type=cosine")
    assert engine_optim(cfg.actor_rollout_ref.actor.optim, 100).lr_schedule == "cosine"
    cfg, _ = _checked("actor_rollout_ref.actor.optim.warmup_style=cosine")  # deprecated spelling wins
    assert engine_optim(cfg.actor_rollout_ref.actor.optim, 100).lr_schedule == "cosine"
    # verl: lr_warmup_steps <= 0 (not only -1) means "use lr_warmup_steps_ratio"
    cfg, _ = _checked("actor_rollout_ref.actor.optim.lr_warmup_steps=0", "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1")
    assert engine_optim(cfg.actor_rollout_ref.actor.optim, 100).warmup_steps == 10
    cfg, _ = _checked("critic.optim.lr_warmup_steps=3")
    assert engine_optim(cfg.critic.optim, 100).warmup_steps == 3


def test_accepted_verl_keys_reach_the_loss_and_the_update():
    cfg, plan = _checked("actor_rollout_ref.actor.loss_scale_factor=512", "actor_rollout_ref.actor.calculate_entropy=True",
                          "actor_rollout_ref.actor.use_torch_compile=False", "data.return_raw_chat=True",
                          "actor_rollout_ref.actor.data_loader_seed=7", "critic.data_loader_seed=7",
                          "data.truncation=middle",
                          "actor_rollout_ref.rollout.mode=sync")
    assert actor_loss_config(cfg, plan.old_log_probs).loss_scale_factor == 512
    assert plan.specs.actor_rollout_ref.actor_train.calculate_entropy is True
    _, plan = _checked("algorithm.adv_estimator=gae", "actor_rollout_ref.actor.loss_scale_factor=64")
    critic = plan.specs.critic
    assert critic.critic.cpu_offload is False and critic.train.loss_fn.keywords["cfg"].loss_scale_factor == 64
