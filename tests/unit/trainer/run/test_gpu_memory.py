"""The start-up check of rollout.gpu_memory_utilization against the models' sizes (no GPU needed:
the device size comes from a faked nvidia-smi, the parameter count from a real safetensors header)."""

import subprocess
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from ballast.trainer.config import ConfigError, load_config
from ballast.trainer.config import gpu_memory
from ballast.trainer.config.gpu_memory import GIB, check_rollout_gpu_memory, checkpoint_param_count

H200_BYTES = 141 * 10**9


def _cfg(*overrides, gpus=1, estimator="grpo"):
    """A colocated run; GRPO (no critic) unless `estimator="gae"` (PPO with a critic worker)."""
    return load_config(["data.train_files=/data/train.parquet", "actor_rollout_ref.model.path=/models/x",
                        f"trainer.n_gpus_per_node={gpus}", f"algorithm.adv_estimator={estimator}", *overrides])


def test_checkpoint_param_count_reads_safetensors_headers(tmp_path):
    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}, str(tmp_path / "m-1.safetensors"))
    save_file({"c": torch.zeros(2, 2, 2)}, str(tmp_path / "m-2.safetensors"))
    assert checkpoint_param_count(str(tmp_path)) == 12 + 5 + 8
    assert checkpoint_param_count(str(tmp_path / "missing")) is None


def test_verl_style_utilization_is_rejected_when_actor_and_ref_shards_are_resident():
    # 7B on one 141 GB GPU with a KL reference: 28 GB actor + 28 GB ref + 56 GB of AdamW moments +
    # overhead leave < 0.2.
    cfg = _cfg("actor_rollout_ref.rollout.gpu_memory_utilization=0.9", "actor_rollout_ref.actor.use_kl_loss=true")
    with pytest.raises(ConfigError) as err:
        check_rollout_gpu_memory(cfg, 7 * 10**9, H200_BYTES)
    message = str(err.value)
    assert "actor_rollout_ref.rollout.gpu_memory_utilization=0.9" in message
    plan = gpu_memory.rollout_memory_plan(cfg, 7 * 10**9, H200_BYTES)
    assert plan.actor_bytes == plan.ref_bytes == 28 * 10**9 and plan.optimizer_bytes == 56 * 10**9
    assert f"use at most {plan.max_utilization:.2f}" in message and 0.1 < plan.max_utilization < 0.2
    assert f"{0.9 * H200_BYTES / GIB:.2f} GiB" in message  # what vLLM will ask to be free


def test_adamw_state_left_by_the_first_update_counts():
    """7B on one 141 GB GPU, no reference: the 28 GB actor shard alone leaves room for 0.5 (the check
    passed this before counting the optimizer), but from the first update on AdamW's two float32
    moments (56 GB) stay resident while every rollout wakes vLLM: the second generate would run out."""
    cfg = _cfg("actor_rollout_ref.rollout.gpu_memory_utilization=0.5")
    with pytest.raises(ConfigError, match=r"AdamW's two float32 moments .*\(52\.15 GiB.*use at most 0\.39"):
        check_rollout_gpu_memory(cfg, 7 * 10**9, H200_BYTES)
    check_rollout_gpu_memory(_cfg("actor_rollout_ref.rollout.gpu_memory_utilization=0.39"), 7 * 10**9, H200_BYTES)
    # LoRA: only the adapter has moments (here 40M parameters: 0.32 GB); CPU offload keeps them in host memory
    lora = _cfg("actor_rollout_ref.rollout.gpu_memory_utilization=0.5", "actor_rollout_ref.model.lora_rank=16")
    assert gpu_memory.rollout_memory_plan(lora, 7 * 10**9, H200_BYTES, adapter_param_count=4 * 10**7).optimizer_bytes \
        == 32 * 10**7
    check_rollout_gpu_memory(lora, 7 * 10**9, H200_BYTES, adapter_param_count=4 * 10**7)
    offloaded = _cfg("actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
                     "actor_rollout_ref.actor.fsdp_config.offload_policy=true")
    assert gpu_memory.rollout_memory_plan(offloaded, 7 * 10**9, H200_BYTES).optimizer_bytes == 0
    # sharded over 8 GPUs, each rank holds an eighth of the moments
    sharded = gpu_memory.rollout_memory_plan(_cfg(gpus=8), 7 * 10**9, H200_BYTES)
    assert sharded.optimizer_bytes == 7 * 10**9


def test_a_model_that_cannot_fit_at_any_utilization_says_so():
    with pytest.raises(ConfigError, match="no value fits: shard the models over more GPUs"):
        check_rollout_gpu_memory(_cfg("actor_rollout_ref.rollout.gpu_memory_utilization=0.1"), 14 * 10**9, H200_BYTES)


def test_the_lora_bound_adapts_every_matrix(tmp_path):
    save_file({"q.weight": torch.zeros(64, 32), "norm.weight": torch.zeros(64)}, str(tmp_path / "m.safetensors"))
    assert gpu_memory.lora_param_bound(gpu_memory.checkpoint_shapes(str(tmp_path)), 8) == 8 * (64 + 32)


def test_the_same_utilization_fits_when_the_shards_are_small_or_offloaded():
    check_rollout_gpu_memory(_cfg("actor_rollout_ref.rollout.gpu_memory_utilization=0.9", gpus=8),
                             7 * 10**9, H200_BYTES)  # 3.5 GB actor shard per GPU, no reference
    # FSDP2 CPU offload (offload_policy) is what keeps the parameters off the GPU; param_offload is a
    # start-up error for the actor (not implemented), so it must not make the check pass.
    offloaded = _cfg("actor_rollout_ref.rollout.gpu_memory_utilization=0.9",
                     "actor_rollout_ref.actor.fsdp_config.offload_policy=true")
    assert gpu_memory.rollout_memory_plan(offloaded, 7 * 10**9, H200_BYTES).actor_bytes == 0
    check_rollout_gpu_memory(offloaded, 7 * 10**9, H200_BYTES)
    ref_offloaded = _cfg("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.ref.fsdp_config.offload_policy=true")
    assert gpu_memory.rollout_memory_plan(ref_offloaded, 7 * 10**9, H200_BYTES).ref_bytes == 0


@pytest.mark.parametrize("fsdp_size, shard_bytes, fits", [(-1, 3_500_000_000, True), (8, 3_500_000_000, True),
                                                          (2, 14 * 10**9, False), (1, 28 * 10**9, False)])
def test_a_rank_holds_one_fsdp_size_th_of_the_actor_and_reference(fsdp_size, shard_bytes, fits):
    """8 GPUs, 7B: fully sharded, each rank holds 1/8; hybrid sharding (fsdp_size=k) 1/k; whole replicas
    (fsdp_size=1) all of it, and the reference model shares the actor's mesh."""
    cfg = _cfg("actor_rollout_ref.rollout.gpu_memory_utilization=0.85", "actor_rollout_ref.actor.use_kl_loss=true",
               f"actor_rollout_ref.actor.fsdp_config.fsdp_size={fsdp_size}", gpus=8)
    plan = gpu_memory.rollout_memory_plan(cfg, 7 * 10**9, H200_BYTES)
    assert plan.actor_bytes == plan.ref_bytes == shard_bytes and plan.optimizer_bytes == 2 * shard_bytes
    if fits:
        check_rollout_gpu_memory(cfg, 7 * 10**9, H200_BYTES)
        return
    with pytest.raises(ConfigError) as err:  # 4 x 14 GB or 4 x 28 GB beside a 0.85 x 141 GB request
        check_rollout_gpu_memory(cfg, 7 * 10**9, H200_BYTES)
    assert f"fsdp_size={fsdp_size} over 8 GPU(s)" in str(err.value)
    assert f"use at most {plan.max_utilization:.2f}" in str(err.value) and plan.max_utilization < 0.8


def test_a_colocated_critic_counts_with_its_own_process():
    """PPO (GAE): the critic worker's shards, its AdamW moments and its CUDA context share every GPU
    with the vLLM engine."""
    grpo = _cfg("actor_rollout_ref.rollout.gpu_memory_utilization=0.7")
    gae = _cfg("actor_rollout_ref.rollout.gpu_memory_utilization=0.7", estimator="gae")
    check_rollout_gpu_memory(grpo, 2 * 10**9, H200_BYTES)  # 8 GB actor + 16 GB moments + 1 GiB: up to 0.82 fits
    plan = gpu_memory.rollout_memory_plan(gae, 2 * 10**9, H200_BYTES)
    assert plan.critic_bytes == 8 * 10**9 and plan.overhead_bytes == 2 * GIB
    assert plan.optimizer_bytes == 32 * 10**9  # the actor's and the critic's
    with pytest.raises(ConfigError, match=r"critic \(7\.45 GiB\).*use at most 0\.64"):
        check_rollout_gpu_memory(gae, 2 * 10**9, H200_BYTES)
    # a smaller value model of its own, a critic shard over fsdp_size, or an offloaded critic
    assert gpu_memory.rollout_memory_plan(gae, 7 * 10**9, H200_BYTES, critic_param_count=10**9).critic_bytes == 4 * 10**9
    sharded = _cfg("critic.fsdp_config.fsdp_size=4", gpus=8, estimator="gae")
    assert gpu_memory.rollout_memory_plan(sharded, 7 * 10**9, H200_BYTES).critic_bytes == 7 * 10**9
    offloaded = _cfg("critic.fsdp_config.offload_policy=true", estimator="gae")
    assert gpu_memory.rollout_memory_plan(offloaded, 7 * 10**9, H200_BYTES).critic_bytes == 0


def test_too_small_a_utilization_for_vllms_own_weights_needs_a_fixed_kv_cache():
    cfg = _cfg("actor_rollout_ref.rollout.gpu_memory_utilization=0.05", gpus=8)
    with pytest.raises(ConfigError, match="less than its own weights .*kv_cache_memory_bytes"):
        check_rollout_gpu_memory(cfg, 7 * 10**9, H200_BYTES)  # 14 GB of bf16 weights > 7 GB
    fixed = _cfg("actor_rollout_ref.rollout.gpu_memory_utilization=0.05",
                 "actor_rollout_ref.rollout.kv_cache_memory_bytes=67108864", gpus=8)
    check_rollout_gpu_memory(fixed, 460_000, H200_BYTES)


def test_start_up_check_uses_nvidia_smi_and_the_checkpoint(tmp_path, monkeypatch):
    save_file({"w": torch.zeros(1000, 1000)}, str(tmp_path / "model.safetensors"))
    cfg = _cfg(f"actor_rollout_ref.model.path={tmp_path}", "actor_rollout_ref.rollout.gpu_memory_utilization=0.99")
    monkeypatch.setattr(gpu_memory.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        return SimpleNamespace(stdout="143771\n81559\n")  # MiB, as nvidia-smi prints them

    monkeypatch.setattr(subprocess, "run", fake_run)
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=0\.99 .*use at most 0\.98"):
        gpu_memory.check_rollout_gpu_memory_at_start(cfg)  # the smaller GPU (80 GiB) counts
    assert "--query-gpu=memory.total" in seen[0]
    ok = _cfg(f"actor_rollout_ref.model.path={tmp_path}", "actor_rollout_ref.rollout.gpu_memory_utilization=0.5")
    assert gpu_memory.check_rollout_gpu_memory_at_start(ok).total_bytes == 81559 << 20
    assert gpu_memory.check_rollout_gpu_memory_at_start(ok).optimizer_bytes == 8 * 1000 * 1000
    lora = _cfg(f"actor_rollout_ref.model.path={tmp_path}", "actor_rollout_ref.rollout.gpu_memory_utilization=0.5",
                "actor_rollout_ref.model.lora_rank=4")
    assert gpu_memory.check_rollout_gpu_memory_at_start(lora).optimizer_bytes == 8 * 4 * (1000 + 1000)
    assert gpu_memory.check_rollout_gpu_memory_at_start(_cfg("trainer.device=cpu")) is None


def test_no_gpu_on_the_driver_skips_the_check(monkeypatch):
    monkeypatch.setattr(gpu_memory.shutil, "which", lambda name: None)
    assert gpu_memory.check_rollout_gpu_memory_at_start(_cfg("actor_rollout_ref.rollout.gpu_memory_utilization=1.0")) is None


def test_gpu_smoke_grpo_overrides_form_a_valid_config_that_fits_an_h200():
    """scripts/gpu_smoke.sh's GRPO phase only ever runs on a GPU machine: check its overrides here."""
    import re
    import shlex
    from pathlib import Path

    from ballast.trainer.run.run_plan import plan_run

    script = (Path(__file__).resolve().parents[4] / "scripts" / "gpu_smoke.sh").read_text()
    block = script[script.index("-m ballast.trainer.main"):script.index('} >"$OUT/grpo.log"')]
    values = {"OUT": "/smoke", "RUN": "/smoke/grpo", "WORKERS": "2", "KV_BYTES": str(64 << 20), "GRPO_S": "300"}
    block = re.sub(r"\$(\w+)", lambda m: values[m.group(1)], block.replace("\\\n", " "))
    overrides = [tok for tok in shlex.split(block)[1:] if "=" in tok]
    assert "actor_rollout_ref.rollout.kv_cache_memory_bytes=67108864" in overrides
    cfg = load_config(overrides)
    plan_run(cfg, None, total_steps=cfg.trainer.total_training_steps)
    check_rollout_gpu_memory(cfg, 460_000, H200_BYTES)  # the tiny preset: well under a million parameters
