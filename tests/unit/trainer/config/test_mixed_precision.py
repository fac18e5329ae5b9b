"""verl's `fsdp_config.mixed_precision` keys: which compute precision each engine gets, what the
reference and `critic.model` inherit, and the values refused at start-up (naming the key)."""

import pytest

from ballast.trainer.config import ConfigError, ModelInfo, load_config
from ballast.trainer.run.run_plan import plan_run

REQUIRED = ["data.train_files=/data/train.parquet", "actor_rollout_ref.model.path=/models/tiny"]
# 2 workers, GAE (actor, reference with a KL loss, critic), static micro-batches.
BASE = REQUIRED + [
    "trainer.n_gpus_per_node=2", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.use_kl_loss=true",
    "critic.ppo_micro_batch_size_per_gpu=2", "data.max_prompt_length=32", "data.max_response_length=32",
    "algorithm.adv_estimator=gae",
]
TINY = ModelInfo(num_attention_heads=4, num_key_value_heads=2, hidden_size=128, num_hidden_layers=2,
                 intermediate_size=256, vocab_size=512, max_position_embeddings=2048)
ACTOR = "actor_rollout_ref.actor.fsdp_config.mixed_precision"
REF = "actor_rollout_ref.ref.fsdp_config.mixed_precision"
CRITIC = "critic.fsdp_config.mixed_precision"


def _precisions(*overrides):
    specs = plan_run(load_config(BASE + list(overrides)), TINY, total_steps=10).specs
    arr = specs.actor_rollout_ref
    return arr.actor.precision, arr.ref.precision, specs.critic.critic.precision


def test_default_is_the_devices_own_precision_for_every_engine():
    assert _precisions() == ("auto", "auto", "auto")
    assert _precisions(f"{ACTOR}=null", f"{CRITIC}=null") == ("auto", "auto", "auto")


def test_actor_bf16_reaches_the_reference_but_not_the_critic():
    assert _precisions(f"{ACTOR}.param_dtype=bf16") == ("bf16", "bf16", "auto")
    # verl's spellings; the reference's own value wins over the actor's
    assert _precisions(f"{ACTOR}.param_dtype=bfloat16", f"{REF}.param_dtype=float32",
                       f"{CRITIC}.param_dtype=bf16") == ("bf16", "fp32", "bf16")
    assert _precisions(f"{ACTOR}.param_dtype=fp32", f"{ACTOR}.reduce_dtype=fp32",
                       f"{ACTOR}.buffer_dtype=float32") == ("fp32", "fp32", "auto")


def test_critic_model_spelling_inherits_field_by_field():
    assert _precisions(f"{CRITIC}.param_dtype=bf16", "critic.model.fsdp_config.mixed_precision.reduce_dtype=fp32",
                       ) == ("auto", "auto", "bf16")
    assert _precisions(f"{CRITIC}.param_dtype=bf16", "critic.model.fsdp_config.mixed_precision.param_dtype=fp32",
                       ) == ("auto", "auto", "fp32")


@pytest.mark.parametrize("override, fragment", [
    (f"{ACTOR}.param_dtype=fp16", rf"{ACTOR}\.param_dtype='fp16': fp16 training needs loss scaling"),
    (f"{REF}.param_dtype=int8", rf"{REF}\.param_dtype='int8' is not a dtype Ballast trains in"),
    (f"{ACTOR}.reduce_dtype=bf16", rf"{ACTOR}\.reduce_dtype='bf16': gradients are reduced in fp32 only"),
    (f"{CRITIC}.buffer_dtype=bf16", rf"{CRITIC}\.buffer_dtype='bf16': buffers are kept in fp32 only"),
    (f"+{ACTOR}.keep_low_precision_grads=true", "keep_low_precision_grads"),
])
def test_values_ballast_does_not_train_with_are_refused_naming_the_key(override, fragment):
    with pytest.raises(ConfigError, match=fragment):
        _precisions(override)


def test_start_up_names_the_precision_only_when_set_and_warns_without_bf16_instructions():
    from ballast.trainer.config.fsdp import precision_notes

    roles = ["actor", "ref", "critic"]
    default = dict(zip(roles, _precisions()))
    assert precision_notes(default, "cpu", native_bf16=False) == []
    bf16 = dict(zip(roles, _precisions(f"{ACTOR}.param_dtype=bf16")))
    lines = precision_notes(bf16, "cpu", native_bf16=True)
    assert len(lines) == 1 and lines[0].startswith("compute precision: actor bf16, ref bf16, critic auto")
    lines = precision_notes(bf16, "cpu", native_bf16=False)
    assert len(lines) == 2 and "without bf16 instructions" in lines[1]
    assert len(precision_notes(bf16, "cuda", native_bf16=False)) == 1  # GPUs have bf16


def test_native_bf16_is_read_from_the_cpu_flags(tmp_path):
    from ballast.trainer.run.preflight import cpu_has_native_bf16

    def cpuinfo(flags_line):
        path = tmp_path / "cpuinfo"
        path.write_text(f"processor\t: 0\nmodel name\t: Some CPU\n{flags_line}\n\nprocessor\t: 1\n")
        return str(path)

    assert cpu_has_native_bf16(cpuinfo("flags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni"))
    assert cpu_has_native_bf16(cpuinfo("flags\t\t: fpu avx512f amx_tile amx_bf16"))
    assert cpu_has_native_bf16(cpuinfo("Features\t: fp asimd bf16 i8mm"))  # Arm
    assert not cpu_has_native_bf16(cpuinfo("flags\t\t: fpu sse avx2 fma avx512f avx512bw"))
    assert not cpu_has_native_bf16(str(tmp_path / "missing"))
