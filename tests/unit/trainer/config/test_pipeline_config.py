"""verl's pipeline keys (`<role>.megatron.pipeline_model_parallel_size`, `virtual_pipeline_model_parallel_size`,
`override_transformer_config.microbatch_group_size_per_vp_stage`) and Ballast's `pipeline_schedule`: the
derived sizes, the planner's policy, the engine spec, and every start-up error naming its keys."""

import pytest

from ballast.trainer.config import ConfigError, derive_sizes, load_config
from ballast.trainer.config.model_info import ModelInfo
from ballast.trainer.run.builders import worker_specs as _worker_specs
from ballast.trainer.step.old_log_probs import old_log_prob_source

BASE = ["data.train_files=/data/train.parquet", "actor_rollout_ref.model.path=/models/tiny",
        "trainer.n_gpus_per_node=4", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=256", "data.max_prompt_length=16",
        "data.max_response_length=32", "algorithm.adv_estimator=grpo"]
PP = "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size"
VPP = "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size"
GROUP = "actor_rollout_ref.actor.megatron.override_transformer_config.microbatch_group_size_per_vp_stage"
SCHEDULE = "actor_rollout_ref.actor.pipeline_schedule"
MODEL = ModelInfo(num_attention_heads=4, num_key_value_heads=2, hidden_size=64, num_hidden_layers=8,
                  intermediate_size=128, vocab_size=128, max_position_embeddings=1024)


def _cfg(*overrides):
    return load_config(BASE + list(overrides))


def worker_specs(cfg, sizes, total_steps):
    """The worker specs as `plan_run` builds them, with the run's old-log-prob source."""
    return _worker_specs(cfg, sizes, total_steps, old_log_prob_source(cfg, sizes))


def _sizes(*overrides, model=MODEL):
    return derive_sizes(_cfg(*overrides), model)


def test_pipeline_sizes_divide_the_workers_and_carry_the_cost_model():
    sizes = _sizes(f"{PP}=2", f"{SCHEDULE}=interleaved_1f1b", f"{VPP}=2", "actor_rollout_ref.actor.use_kl_loss=true")
    actor = sizes.actor
    assert (actor.dp_size, actor.pp_size, actor.mini_batch_samples_per_rank) == (2, 2, 8)
    shape = actor.pipeline.shape
    assert (shape.pp_size, shape.virtual_stages, str(shape.schedule)) == (2, 2, "interleaved_1f1b")
    assert sum(actor.pipeline.stage_layers) == MODEL.num_hidden_layers and len(actor.pipeline.stage_layers) == 4
    assert actor.policy(actor.train).pipeline is actor.pipeline
    assert actor.policy(actor.train).token_budget == 256
    assert sizes.ref.pp_size == 2 and sizes.ref.pipeline == actor.pipeline  # verl: the reference takes the actor's
    assert "pp=2 v=2 schedule=interleaved_1f1b" in "\n".join(sizes.summary())
    plain = _sizes()
    assert plain.actor.pipeline is None and plain.actor.dp_size == 4 and plain.actor.policy(plain.actor.train).pipeline is None


def test_the_engine_spec_gets_the_pipeline(tmp_path):
    cfg = _cfg(f"{PP}=2", f"{SCHEDULE}=zero_bubble", f"{VPP}=2", f"{GROUP}=2")
    specs = worker_specs(cfg, derive_sizes(cfg, MODEL), total_steps=3)
    pipeline = specs.actor_rollout_ref.actor.pipeline
    assert (pipeline.pp_size, pipeline.virtual_stages, pipeline.schedule, pipeline.microbatch_group_size) == \
        (2, 2, "zero_bubble", 2)
    assert not worker_specs(_cfg(), derive_sizes(_cfg(), MODEL), 3).actor_rollout_ref.actor.pipeline.enabled


@pytest.mark.parametrize("overrides,fragment", [
    ([f"{PP}=3"], f"not divisible by {PP}=3"),
    ([f"{PP}=0"], f"{PP}=0 must be >= 1"),
    ([f"{PP}=2", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"],
     f"{PP}=2 does not compose with Ulysses: actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"),
    ([f"{PP}=2", "actor_rollout_ref.model.use_remove_padding=false"],
     "needs actor_rollout_ref.model.use_remove_padding=True"),
    ([f"{PP}=2", "actor_rollout_ref.actor.use_prefix_grouper=true"],
     "does not compose with actor_rollout_ref.actor.use_prefix_grouper=True"),
    ([f"{PP}=2", "actor_rollout_ref.actor.dynamic_bsz_bucketing=true"],
     "does not compose with actor_rollout_ref.actor.dynamic_bsz_bucketing=True"),
    ([f"{PP}=4", f"{VPP}=4", f"{SCHEDULE}=interleaved_1f1b", "trainer.n_gpus_per_node=4"],
     "16 stages, but the model has 8 decoder layers"),
    ([f"{PP}=2", f"{VPP}=2"], "virtual_stages=2 needs schedule 'interleaved_1f1b' or 'zero_bubble'"),
    ([f"{PP}=2", f"{VPP}=2", f"{SCHEDULE}=interleaved_1f1b", f"{GROUP}=4"],
     "microbatch_group_size_per_vp_stage=4 with virtual stages"),
    ([f"{VPP}=2"], "virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size > 1"),
])
def test_what_a_pipeline_cannot_run_is_a_start_up_error_naming_the_keys(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        _sizes(*overrides)


def test_a_pipeline_needs_the_model_config():
    with pytest.raises(ConfigError, match="needs the model's config.json"):
        _sizes(f"{PP}=2", model=None)


def test_the_schedule_is_a_closed_choice():
    with pytest.raises(ConfigError, match="gpipe"):
        _cfg(f"{SCHEDULE}=gpipe")


def test_the_engine_names_the_key_of_what_it_does_not_compose_with(tmp_path):
    for override, key in [("actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_rank"),
                          ("actor_rollout_ref.actor.fsdp_config.fsdp_size=2", "actor_rollout_ref.actor.fsdp_config.fsdp_size"),
                          ("actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
                           "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype")]:
        cfg = _cfg(f"{PP}=2", override)
        with pytest.raises(ConfigError, match=f"^{key}: pipeline parallelism"):
            worker_specs(cfg, derive_sizes(cfg, MODEL), total_steps=3)
