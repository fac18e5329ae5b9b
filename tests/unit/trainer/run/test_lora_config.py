"""verl's LoRA keys (`model.lora_rank`, `lora_alpha`, `target_modules`, `exclude_modules`,
`lora_adapter_path`, `lora.merge`, `rollout.layered_summon`) reach the engine, rollout and sync specs,
the reference policy of a LoRA run is the actor itself, and bad values fail at start-up naming the key."""

import json

import pytest

from ballast.trainer.config import ConfigError, ModelInfo, load_config
from ballast.trainer.config.gpu_memory import rollout_memory_plan
from ballast.trainer.run.workers import weight_sync_report
from ballast.trainer.run.run_plan import plan_run

TINY = ModelInfo(4, 2, 128, 2, 256, 512, 2048)
BASE = ["data.train_files=/d.parquet", "actor_rollout_ref.model.path=/m", "trainer.n_gpus_per_node=2",
        "trainer.device=cpu", "data.train_batch_size=8", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048", "data.max_prompt_length=128",
        "data.max_response_length=256", "algorithm.adv_estimator=grpo"]
LORA = ["actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora_alpha=32"]


def _plan(*extra):
    cfg = load_config(BASE + list(extra))
    return cfg, plan_run(cfg, TINY, total_steps=10)


def test_full_fine_tuning_stays_as_it_was():
    _, plan = _plan("actor_rollout_ref.actor.use_kl_loss=True")
    spec = plan.specs.actor_rollout_ref
    assert not spec.actor.lora.enabled and spec.rollout.max_lora_rank is None
    assert spec.ref is not None and not spec.ref_in_actor and not spec.weight_sync.check


def test_lora_keys_reach_the_actor_and_the_rollout():
    _, plan = _plan(*LORA, "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
                    "actor_rollout_ref.model.exclude_modules=[o_proj]", "actor_rollout_ref.rollout.layered_summon=True")
    spec = plan.specs.actor_rollout_ref
    lora = spec.actor.lora
    assert (lora.rank, lora.alpha, lora.target_modules, lora.exclude_modules) == (16, 32, ("q_proj", "v_proj"), ("o_proj",))
    assert spec.rollout.max_lora_rank == 16  # the rollout serves the adapter: adapter-only sync
    assert spec.weight_sync.layered and spec.weight_sync.check and spec.weight_sync.check_tolerance is None
    assert plan_run(load_config(BASE + LORA), TINY, 10).specs.actor_rollout_ref.actor.lora.target_modules == "all-linear"


def test_no_reference_model_with_lora():
    cfg, plan = _plan(*LORA, "actor_rollout_ref.actor.use_kl_loss=True")
    spec = plan.specs.actor_rollout_ref
    assert spec.ref is None and spec.ref_in_actor and plan.sizes.use_reference
    assert rollout_memory_plan(cfg, 10**9, 80 << 30).ref_bytes == 0  # no second copy of the weights
    assert rollout_memory_plan(load_config(BASE + ["actor_rollout_ref.actor.use_kl_loss=True"]), 10**9,
                               80 << 30).ref_bytes > 0
    with pytest.raises(ConfigError, match="actor_rollout_ref.ref.ulysses_sequence_parallel_size=2 differs"):
        _plan(*LORA, "algorithm.use_kl_in_reward=True", "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2")


def test_the_sync_check_probe_fits_the_rollout_engines_context():
    """vLLM scores a prompt only with room for one generated token: the probe is cut one short of the
    engine's context (a 56-token context refused a 56-token probe at start-up)."""
    sync = _plan(*LORA)[1].specs.actor_rollout_ref.weight_sync
    assert sync.probe_max_tokens == 96 and sync.tokenizer_path == "/m"  # 128 + 256 tokens of context
    small = _plan(*LORA, "data.max_prompt_length=32", "data.max_response_length=24",
                  "actor_rollout_ref.rollout.max_model_len=56")[1].specs.actor_rollout_ref.weight_sync
    assert small.probe_max_tokens == 55


def test_merge_and_the_check_switches():
    _, plan = _plan(*LORA, "actor_rollout_ref.model.lora.merge=True",
                    "actor_rollout_ref.rollout.weight_sync_check=False")
    spec = plan.specs.actor_rollout_ref
    assert spec.rollout.max_lora_rank is None and not spec.weight_sync.check
    _, plan = _plan("actor_rollout_ref.rollout.weight_sync_check=True",
                    "actor_rollout_ref.rollout.weight_sync_check_tolerance=0.01")
    assert plan.specs.actor_rollout_ref.weight_sync.check_tolerance == 0.01  # also for full fine-tuning
    with pytest.raises(ConfigError, match="weight_sync_check_tolerance=0.0 must be > 0"):
        _plan("actor_rollout_ref.rollout.weight_sync_check_tolerance=0.0")


def test_an_adapter_to_start_from_decides_the_rank(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "rank_pattern": {"q_proj": 24}}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    _, plan = _plan(f"actor_rollout_ref.model.lora_adapter_path={tmp_path}", "actor_rollout_ref.actor.use_kl_loss=True")
    spec = plan.specs.actor_rollout_ref
    assert spec.actor.lora.enabled and spec.actor.lora.adapter_path == str(tmp_path)
    assert spec.rollout.max_lora_rank == 24 and spec.ref_in_actor


@pytest.mark.parametrize("override, key", [
    ("actor_rollout_ref.model.lora_rank=-2", "actor_rollout_ref.model.lora_rank"),
    ("actor_rollout_ref.model.lora_alpha=0", "actor_rollout_ref.model.lora_alpha"),
    ("actor_rollout_ref.model.target_modules=''", "actor_rollout_ref.model.target_modules"),
    ("actor_rollout_ref.model.lora_adapter_path=/no/adapter", "actor_rollout_ref.model.lora_adapter_path"),
    ("critic.model.lora_rank=-1", "critic.model.lora_rank"),
])
def test_bad_values_name_the_key(override, key):
    extra = ["algorithm.adv_estimator=gae"] if override.startswith("critic") else []
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _plan(override, *extra)


def test_the_critic_gets_its_own_adapter():
    _, plan = _plan("algorithm.adv_estimator=gae", "critic.model.lora_rank=4", "critic.model.target_modules=[q_proj]")
    critic = plan.specs.critic.critic
    assert critic.lora.rank == 4 and critic.lora.target_modules == ("q_proj",)
    assert not plan.specs.actor_rollout_ref.actor.lora.enabled


def test_start_up_report_of_what_a_sync_moves():
    assert weight_sync_report([{"rank": 0}, {"rank": 1, "weight_sync": "full"}]) == ""
    assert "adapter only (rank 16)" in weight_sync_report([{"weight_sync": "adapter", "adapter_rank": 16}])
    merged = weight_sync_report([{"weight_sync": "merged", "adapter_rank": 600,
                                  "adapter_unavailable": "rank 600 exceeds vLLM's largest LoRA rank"}])
    assert "merged weights" in merged and "rank 600" in merged
    assert "lora.merge=True" in weight_sync_report([{"weight_sync": "merged", "adapter_rank": 8}])


def test_both_rollout_modes_serve_the_adapter_to_the_same_agent_loops():
    # one request-level rollout whatever rollout.mode says: every request names the served adapter
    _, sync = _plan(*LORA, "actor_rollout_ref.rollout.mode=sync")
    _, agent = _plan(*LORA, "actor_rollout_ref.rollout.mode=async")
    spec, same = agent.specs.actor_rollout_ref, sync.specs.actor_rollout_ref
    assert (spec.rollout, spec.agent, spec.rollout_val_sampling) == (same.rollout, same.agent, same.rollout_val_sampling)
    assert spec.agent.default_agent_loop == "single_turn_agent" and spec.rollout.max_lora_rank == 16
