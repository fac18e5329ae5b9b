"""Config keys reach the specs the workers are built from (rollout knobs into vLLM's kwargs, batch
sizes, bucketing, adaptive clipping, loss settings)."""

import dataclasses

import pytest

from ballast.trainer.run.builders import rollout_config
from ballast.trainer.config import ConfigError, ModelInfo, load_config
from ballast.trainer.run.run_plan import plan_run
from ballast.workers.rollout.vllm_backend import engine_kwargs

TINY = ModelInfo(4, 2, 128, 2, 256, 512, 2048)
BASE = ["data.train_files=/d.parquet", "actor_rollout_ref.model.path=/m", "trainer.n_gpus_per_node=2",
        "trainer.device=cpu", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048", "data.max_prompt_length=128",
        "data.max_response_length=256"]


def _spec(*extra):
    cfg = load_config(BASE + list(extra))
    plan = plan_run(cfg, TINY, total_steps=100)
    return cfg, plan.sizes, plan.specs.actor_rollout_ref


def test_rollout_knobs_reach_vllm():
    cfg, _, _ = _spec("actor_rollout_ref.rollout.max_num_batched_tokens=4096",
                      "actor_rollout_ref.rollout.max_model_len=1024", "actor_rollout_ref.rollout.enable_chunked_prefill=False",
                      "actor_rollout_ref.rollout.enforce_eager=False", "actor_rollout_ref.rollout.cpu_kv_cache_gib=2",
                      "actor_rollout_ref.rollout.max_num_seqs=64", "actor_rollout_ref.rollout.block_size=32")
    kwargs = engine_kwargs(rollout_config(cfg), distributed=True)
    assert kwargs["block_size"] == 32
    assert "block_size" not in engine_kwargs(rollout_config(_spec()[0]), distributed=True)  # null: vLLM's default
    assert kwargs["max_num_batched_tokens"] == 4096 and kwargs["max_model_len"] == 1024
    assert kwargs["enable_chunked_prefill"] is False and kwargs["enforce_eager"] is False
    assert kwargs["kv_cache_memory_bytes"] == 2 << 30 and kwargs["max_num_seqs"] == 64
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    gpu_cfg, _, _ = _spec("trainer.device=cuda", "actor_rollout_ref.rollout.gpu_memory_utilization=0.85",
                          "actor_rollout_ref.rollout.free_cache_engine=False")
    gpu = rollout_config(gpu_cfg)
    assert gpu.gpu_memory_utilization == 0.85 and gpu.free_cache_engine is False and gpu.kv_cache_memory_bytes is None
    # on GPU the size comes from gpu_memory_utilization, never from the CPU setting
    assert "kv_cache_memory_bytes" not in engine_kwargs(gpu, distributed=True)
    # ... unless a fixed size is given (small models: a fraction of a large GPU is millions of blocks)
    fixed_cfg, _, _ = _spec("trainer.device=cuda", "actor_rollout_ref.rollout.kv_cache_memory_bytes=67108864")
    assert engine_kwargs(rollout_config(fixed_cfg), distributed=True)["kv_cache_memory_bytes"] == 64 << 20
    # trainer.device=auto resolves in the worker: the CPU cache size still applies when it lands on CPU
    auto_cfg, _, _ = _spec("trainer.device=auto", "actor_rollout_ref.rollout.cpu_kv_cache_gib=3")
    assert engine_kwargs(dataclasses.replace(rollout_config(auto_cfg), device="cpu"), False)["kv_cache_memory_bytes"] == 3 << 30


def test_default_max_model_len_is_prompt_plus_response():
    cfg, _, _ = _spec()
    assert rollout_config(cfg).max_model_len == 384


@pytest.mark.parametrize("override, key", [
    ("actor_rollout_ref.rollout.gpu_memory_utilization=1.5", "gpu_memory_utilization=1.5"),
    ("actor_rollout_ref.rollout.cpu_kv_cache_gib=0", "rollout.cpu_kv_cache_gib: cpu_kv_cache_memory_bytes=0"),
    ("actor_rollout_ref.rollout.max_model_len=200", "max_model_len=200"),
    ("actor_rollout_ref.rollout.max_num_seqs=0", "max_num_seqs=0"),
    ("actor_rollout_ref.rollout.kv_cache_memory_bytes=0", "kv_cache_memory_bytes=0"),
])
def test_invalid_rollout_knobs_are_start_up_errors(override, key):
    with pytest.raises(ConfigError, match=key):
        _spec(override)


def test_actor_spec_carries_sizes_bucketing_and_adaptive_clip():
    cfg, sizes, spec = _spec("actor_rollout_ref.actor.dynamic_bsz_bucketing=True",
                             "actor_rollout_ref.actor.bucket_boundaries=[64,256]",
                             "actor_rollout_ref.actor.grad_clip_adaptive=True",
                             "actor_rollout_ref.actor.grad_clip_min_batch_size=8",
                             "actor_rollout_ref.actor.clip_ratio_high=0.28", "actor_rollout_ref.rollout.temperature=0.7")
    train = spec.actor_train
    assert sizes.actor.mini_batch_samples_per_rank == 4  # the driver plans with it; the spec has no sizes
    assert sizes.actor.train.max_token_len_per_gpu == 2048 and sizes.actor.train.bucket_boundaries == (64, 256)
    assert train.grad_clip_min_batch_size == 8 and train.temperature == 0.7
    loss_cfg = train.loss_fn.keywords["cfg"]
    assert (loss_cfg.clip_ratio_low, loss_cfg.clip_ratio_high) == (0.2, 0.28)
    assert spec.rollout.sampling.temperature == 0.7 and spec.rollout_val_sampling.do_sample is False
    assert spec.ref is None  # no KL: no reference model
    _, _, no_adaptive = _spec()
    assert no_adaptive.actor_train.grad_clip_min_batch_size is None


def test_critic_spec_for_gae():
    cfg = load_config(BASE + ["algorithm.adv_estimator=gae", "critic.optim.lr=3e-5"])
    plan = plan_run(cfg, TINY, total_steps=10)
    spec, sizes = plan.specs.critic, plan.sizes
    assert spec.critic.role == "critic" and spec.critic.optim.lr == 3e-5
    assert sizes.critic.train.use_dynamic_bsz and sizes.critic.mini_batch_samples_per_rank == 4
