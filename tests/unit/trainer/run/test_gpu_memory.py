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
    # 7B on one 141 GB GPU with a KL reference: 28 GB actor + 28 GB ref + overhead leave < 0.6.
    cfg = _cfg("actor_rollout_ref.rollout.gpu_memory_utilization=0.9", "actor_rollout_ref.actor.use_kl_loss=true")
    with pytest.raises(ConfigError) as err:
        check_rollout_gpu_memory(cfg, 7 * 10**9, H200_BYTES)
    message = str(err.value)
    assert "actor_rollout_ref.rollout.gpu_memory_utilization=0.9" in message
    plan = gpu_memory.rollout_memory_plan(cfg, 7 * 10**9, H200_BYTES)
    assert plan.actor_bytes == plan.ref_bytes == 28 * 10**9
    assert f"use at most {plan.max_utilization:.2f}" in message and 0.5 < plan.max_utilization < 0.6
    assert f"{0.9 * H200_BYTES / GIB:.2f} GiB" in message  # what vLLM will ask to be free


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
    cfg = _cfg("actor_rollout_ref.rollout.gpu_memory_utilization=0.9", "actor_rollout_ref.actor.use_kl_loss=true",
               f"actor_rollout_ref.actor.fsdp_config.fsdp_size={fsdp_size}", gpus=8)
    plan = gpu_memory.rollout_memory_plan(cfg, 7 * 10**9, H200_BYTES)
    assert plan.actor_bytes == plan.ref_bytes == shard_bytes
    if fits:
        check_rollout_gpu_memory(cfg, 7 * 10**9, H200_BYTES)
        return
    with pytest.raises(ConfigError) as err:  # 2 x 14 GB or 2 x 28 GB beside a 0.9 x 141 GB request
        check_rollout_gpu_memory(cfg, 7 * 10**9, H200_BYTES)
    assert f"fsdp_size={fsdp_size} over 8 GPU(s)" in str(err.value)
    assert f"use at most {plan.max_utilization:.2f}" in str(err.value) and plan.max_utilization < 0.8


def test_a_colocated_critic_counts_with_its_own_process():
    """PPO (GAE): the critic worker's shards and CUDA context share every GPU with the vLLM engine."""
    grpo = _cfg("actor_rollout_ref.rollout.gpu_memory_utilization=0.7")
    gae = _cfg("actor_rollout_ref.rollout.gpu_memory_utilization=0.7", estimator="gae")
    check_rollout_gpu_memory(grpo, 7 * 10**9, H200_BYTES)  # 28 GB actor + 1 GiB: up to 0.79 fits
    plan = gpu_memory.rollout_memory_plan(gae, 7 * 10**9, H200_BYTES)
    assert plan.critic_bytes == 28 * 10**9 and plan.overhead_bytes == 2 * GIB
    with pytest.raises(ConfigError, match=r"critic \(26\.08 GiB\).*use at most 0\.58"):
        check_rollout_gpu_memory(gae, 7 * 10**9, H200_BYTES)
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
