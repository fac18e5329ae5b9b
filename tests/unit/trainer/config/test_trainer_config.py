"""The typed config: yaml <-> schema agreement, overrides, derived sizes and the start-up errors."""

import dataclasses
import json
import typing

import pytest

from ballast.trainer.config import (
    BallastConfig, ConfigError, ModelInfo, compose, derive_sizes, load_config,
)
from ballast.trainer.run.run_plan import plan_run

REQUIRED = ["data.train_files=/data/train.parquet", "actor_rollout_ref.model.path=/models/tiny"]
# A small valid layout: 4 workers, 8 prompts x 4 samples, static micro-batches.
BASE = REQUIRED + [
    "trainer.n_gpus_per_node=4", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    "critic.ppo_micro_batch_size_per_gpu=2", "data.max_prompt_length=64", "data.max_response_length=64",
]
TINY = ModelInfo(num_attention_heads=4, num_key_value_heads=2, hidden_size=128, num_hidden_layers=2,
                 intermediate_size=256, vocab_size=512, max_position_embeddings=2048)


def _cfg(*overrides, base=BASE):
    return load_config(list(base) + list(overrides))


def _field_tree(cls):
    hints = typing.get_type_hints(cls)
    tree = {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        tp = next((a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)), tp)  # Optional[Section]
        is_mapping = typing.get_origin(tp) is dict  # a free-form mapping (verl's `sampler_kwargs: {}`)
        tree[f.name] = _field_tree(tp) if dataclasses.is_dataclass(tp) else ({} if is_mapping else None)
    return tree


def _key_tree(node):
    from omegaconf import DictConfig
    return {k: _key_tree(node[k]) if isinstance(node._get_node(k), DictConfig) else None for k in node.keys()}


def test_yaml_and_schema_have_exactly_the_same_keys():
    raw = compose(REQUIRED)
    raw_tree = _key_tree(raw)
    raw_tree.pop("hydra", None)
    assert raw_tree == _field_tree(BallastConfig)


def test_defaults_load_into_frozen_typed_objects():
    cfg = load_config(REQUIRED)
    assert isinstance(cfg, BallastConfig)
    assert cfg.data.train_files == ["/data/train.parquet"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.data.train_batch_size = 3  # type: ignore[misc]


def test_overrides_reach_interpolated_keys():
    cfg = _cfg("actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096")
    assert cfg.actor_rollout_ref.ref.log_prob_use_dynamic_bsz is True
    assert cfg.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu == 4096
    assert cfg.critic.use_dynamic_bsz is True


def test_list_of_train_files_is_accepted():
    cfg = load_config(["data.train_files=[/a.parquet,/b.parquet]", REQUIRED[1]])
    assert cfg.data.train_files == ["/a.parquet", "/b.parquet"]


@pytest.mark.parametrize("override, fragment", [
    (["actor_rollout_ref.actor.ppo_micro_batch_size=4"], "ppo_micro_batch_size"),
    (["data.train_batch_size=many"], "data.train_batch_size"),
    (["trainer.balance_batch=maybe"], "trainer.balance_batch"),
])
def test_unknown_keys_and_wrong_types_name_the_key(override, fragment):
    with pytest.raises(ConfigError, match=fragment):
        _cfg(*override)


def test_missing_required_value_names_the_key():
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.model\.path must be set"):
        load_config([REQUIRED[0]])


def test_derived_sizes_static_layout():
    cfg = _cfg("algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=True")
    sizes = plan_run(cfg, TINY, total_steps=100).sizes
    assert sizes.world_size == 4 and sizes.samples_per_step == 32
    assert sizes.actor.dp_size == 4 and sizes.actor.samples_per_rank == 8
    assert sizes.actor.mini_batch_samples == 16 and sizes.actor.mini_batch_samples_per_rank == 4
    assert sizes.actor.num_mini_batches == 2 and sizes.actor.grad_accum_steps == 2
    assert sizes.actor.infer.micro_batch_size_per_gpu == 4
    assert sizes.use_reference and sizes.ref is not None and not sizes.use_critic
    assert sizes.rollout_dp == 4 and sizes.rollout_samples_per_rank == 8


def test_derived_sizes_dynamic_with_sp_and_tp():
    cfg = _cfg("actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=256",
               "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
               "actor_rollout_ref.rollout.tensor_model_parallel_size=2", "critic.ulysses_sequence_parallel_size=2")
    sizes = plan_run(cfg, TINY, total_steps=100).sizes
    assert sizes.actor.dp_size == 2 and sizes.actor.sp_size == 2
    assert sizes.actor.token_budget(sizes.actor.train) == 512 and sizes.actor.grad_accum_steps is None
    assert sizes.actor.mini_batch_samples_per_rank == 8
    assert sizes.rollout_tp == 2 and sizes.rollout_dp == 2
    assert sizes.use_critic and sizes.critic.train.use_dynamic_bsz and sizes.critic.token_budget(sizes.critic.train) == 2 * 32768
    assert any("dynamic(budget=512" in line for line in sizes.summary())


# At least 15 distinct impossible configurations, each with the keys its message must name.
INVALID = [
    (["data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=3", "actor_rollout_ref.rollout.n=1",
      "algorithm.adv_estimator=reinforce_plus_plus", "critic.enable=false"], "not divisible by rollout dp size"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=3"], "not divisible by actor_rollout_ref.actor.ppo_mini_batch_size=3"),
    (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"], "ppo_micro_batch_size_per_gpu=3"),
    (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null"], "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu: "
     "MicroBatchSpec(use_dynamic_bsz=False) needs micro_batch_size_per_gpu >= 1, got None"),
    (["actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=100"],
     "ppo_max_token_len_per_gpu=100"),
    (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=3"], "ulysses_sequence_parallel_size=3"),
    (["trainer.n_gpus_per_node=8", "actor_rollout_ref.actor.ulysses_sequence_parallel_size=8"],
     "num_attention_heads=4 is not divisible"),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=3"], "tensor_model_parallel_size=3"),
    (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator='ppo'"),
    (["actor_rollout_ref.actor.loss_agg_mode=mean"], "actor_rollout_ref.actor.loss_agg_mode='mean'"),
    (["actor_rollout_ref.actor.kl_loss_type=k9"], "kl_loss_type='k9'"),
    (["actor_rollout_ref.actor.clip_ratio_c=0.5"], "clip_ratio_c=0.5"),
    (["actor_rollout_ref.rollout.temperature=0"], "actor_rollout_ref.rollout.temperature: temperature=0.0 must be > 0"),
    (["actor_rollout_ref.rollout.name=sglang"], "actor_rollout_ref.rollout.name: backend='sglang'"),
    (["trainer.logger=[console,mlflow]"], "trainer.logger[1]='mlflow'"),
    (["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1", "data.train_batch_size=16",
      "actor_rollout_ref.actor.ppo_mini_batch_size=8"], "rollout.n=1 must be >= 2"),
    (["critic.enable=false"], "adv_estimator=gae needs a critic"),
    (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "actor_rollout_ref.model.use_remove_padding=False"],
     "actor_rollout_ref.actor.ulysses_sequence_parallel_size: ulysses_sequence_parallel_size=2 needs "
     "use_remove_padding=True"),
    (["actor_rollout_ref.rollout.max_model_len=100"], "max_model_len=100"),
    (["actor_rollout_ref.actor.dynamic_bsz_bucketing=True"],
     "actor_rollout_ref.actor.dynamic_bsz_bucketing: bucket_boundaries=[64, 256, 1024, 4096] needs use_dynamic_bsz=True"),
    (["actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.dynamic_bsz_bucketing=True",
      "actor_rollout_ref.actor.bucket_boundaries=[64,32]"], "actor_rollout_ref.actor.bucket_boundaries: bucket_boundaries=[64, 32] must be"),
    (["actor_rollout_ref.actor.optim.lr=0"], "actor_rollout_ref.actor.optim.lr=0"),
    (["trainer.cpus_per_worker=0"], "trainer.cpus_per_worker=0"),
    (["trainer.ballast_rollout_recovery.max_restarts=-1"], "trainer.ballast_rollout_recovery.max_restarts=-1"),
    (["trainer.ballast_rollout_recovery.generate_timeout_s=0"], "trainer.ballast_rollout_recovery.generate_timeout_s=0"),
    (["trainer.device=tpu"], "trainer.device: engine device must be one of ('auto', 'cpu', 'cuda'), got 'tpu'"),
    (["critic.ppo_micro_batch_size_per_gpu=3"], "critic.ppo_micro_batch_size_per_gpu=3"),
    (["actor_rollout_ref.actor.ppo_mini_batch_size=16"], "ppo_mini_batch_size=16 must be in"),
    (["trainer.resume_mode=/no/such/dir"], "trainer.resume_mode='/no/such/dir'"),
    (["data.persistent_workers=True"], "data.persistent_workers=True needs data.dataloader_num_workers > 0"),
    (["actor_rollout_ref.rollout.top_p=1.5"], "actor_rollout_ref.rollout.top_p: top_p=1.5"),
    (["critic.ulysses_sequence_parallel_size=2", "critic.model.use_remove_padding=False"],
     "critic.ulysses_sequence_parallel_size: ulysses_sequence_parallel_size=2 needs use_remove_padding=True"),
    (["actor_rollout_ref.rollout.do_sample=True", "actor_rollout_ref.rollout.val_kwargs.do_sample=True"],
     "actor_rollout_ref.rollout.val_kwargs.temperature: temperature=0.0 must be > 0"),
    (["actor_rollout_ref.actor.grad_clip=0"], "actor_rollout_ref.actor.grad_clip: grad_clip must be > 0 or None, got 0.0"),
    (["actor_rollout_ref.actor.optim.lr_scheduler_type=cosine", "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=1"],
     "actor_rollout_ref.actor.optim.lr_scheduler_type: optim.lr_schedule='cosine' needs"),
]


@pytest.mark.parametrize("overrides, fragment", INVALID, ids=[frag for _, frag in INVALID])
def test_invalid_config_is_a_start_up_error_naming_the_keys(overrides, fragment):
    with pytest.raises(ConfigError) as info:
        plan_run(_cfg(*overrides), TINY, total_steps=100)
    assert fragment in str(info.value), str(info.value)


def test_model_info_errors_name_the_path(tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        ModelInfo.from_dir(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="no config.json"):
        ModelInfo.from_dir(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read config.json"):
        ModelInfo.from_dir(str(tmp_path))


def test_model_info_reads_head_dim_where_the_config_sets_it(tmp_path):
    base = dict(num_attention_heads=9, num_key_value_heads=3, hidden_size=576, num_hidden_layers=30,
                intermediate_size=1536, vocab_size=49152)
    (tmp_path / "config.json").write_text(json.dumps(base))
    assert ModelInfo.from_dir(str(tmp_path)).resolved_head_dim == 64  # hidden / heads
    (tmp_path / "config.json").write_text(json.dumps({**base, "head_dim": 128}))  # e.g. Qwen3, Gemma
    info = ModelInfo.from_dir(str(tmp_path))
    assert (info.head_dim, info.resolved_head_dim) == (128, 128)
    nested = {"text_config": {**base, "head_dim": 96}}  # multimodal configs nest the language model's
    (tmp_path / "config.json").write_text(json.dumps(nested))
    assert ModelInfo.from_dir(str(tmp_path)).resolved_head_dim == 96


def test_quickstart_config_is_valid():
    cfg = load_config([], config_name="quickstart")
    sizes = derive_sizes(cfg, TINY)
    assert sizes.world_size == 2 and sizes.actor.train.use_dynamic_bsz
    assert sizes.samples_per_step == cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
