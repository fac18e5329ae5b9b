"""LoRA runs through the whole driver loop: GRPO with a KL loss trains an adapter (the reference is the
actor with its adapter off, no second model), the vLLM rollout serves each adapter version (checked after
every sync) to tool-agent conversations whose every request names it, checkpoints hold the adapter only;
PPO with adapters on actor and critic and merged-weight sync, with rollout correction's bypass mode (the
rollout's log-probs as the old policy) next to the adapter-off reference; and a run whose adapter never
reaches the rollout stops, naming the cause (HF rollout: the check is the same code for every backend,
and the vLLM run above shows it can tell vLLM serving the adapter from vLLM serving the base model)."""

import math
import os
from pathlib import Path

import pytest

from ballast.trainer.config import load_config
from ballast.trainer.main import EXIT_WORKER_FAILED, prepare_typed, training_session

from testkit.e2e import killed_on_exit, last_line, overrides, run_dir, start_trainer

LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.actor.optim.lr=2e-2"]
BROKEN_SYNC = str(Path(__file__).resolve().parents[1] / "testkit" / "broken_sync")


@pytest.fixture()
def prepared(tiny_task, e2e_ray, tmp_path):
    def make(name, *extra):
        return prepare_typed(load_config(overrides(tiny_task, run_dir(tmp_path, name), *extra)))

    return make


def _dir_bytes(path):
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


@pytest.mark.vllm
def test_lora_grpo_with_kl_serves_every_adapter_version_to_tool_agents(prepared, tmp_path, capfd):
    # tool-agent conversations submit their own requests: each must name the served adapter, or vLLM
    # would sample from the base model while the check probes the adapter (the rollout-vs-actor diff
    # at step 2 would show it)
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: calculator\n    config: {type: native, timeout_s: 5}\n")
    extra = [*LORA, "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.calculate_log_probs=True",
             "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.1",
             "actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.multi_turn.enable=True",
             f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
             "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
             "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
             "trainer.total_training_steps=2", "trainer.save_freq=2"]
    run = prepared("lora_vllm", *extra)
    spec = run.plan.specs.actor_rollout_ref
    assert spec.ref is None and spec.ref_in_actor and run.plan.sizes.use_reference  # no second model
    with training_session(run) as trainer:
        metrics = trainer.fit()
    out = capfd.readouterr()
    assert "LoRA weight sync: adapter only (rank 8)" in out.out + out.err
    for key in ("rollout/sync_check/mean_abs_diff", "rollout/sync_check/adapter_effect", "actor/kl_loss",
                "timing_s/update_weights", "training/rollout_actor_log_prob_diff/max", "agent/num_turns/mean"):
        assert key in metrics and math.isfinite(metrics[key]), key
    bad = [k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)]
    assert not bad, bad
    # step 2 samples with the adapter of the first update: vLLM serves exactly it
    assert metrics["rollout/sync_check/mean_abs_diff"] < 1e-4
    assert metrics["rollout/sync_check/adapter_effect"] > 1e-3  # the check could have told base from adapter
    assert metrics["training/rollout_actor_log_prob_diff/max"] < 1e-3
    assert metrics["actor/kl_loss"] > 0  # the reference (adapter off) differs from the trained actor
    ckpt = os.path.join(str(tmp_path), "lora_vllm", "global_step_2", "actor")
    model_bytes = _dir_bytes(run.cfg.actor_rollout_ref.model.path)
    assert 0 < _dir_bytes(ckpt) < model_bytes / 2, "a LoRA checkpoint holds the adapter, not the base weights"


def test_ppo_with_adapters_merged_sync_bypass_correction_and_a_kl_loss(prepared, tmp_path):
    # PPO with an adapter on the actor and one on the critic (which also trains its fresh value head
    # whole); the actor's adapter reaches the rollout merged into the weights. Rollout correction's
    # bypass mode takes the rollout's log-probs as the old policy while the KL loss's reference is the
    # actor with its adapter off: all in one run.
    extra = [*LORA, "algorithm.adv_estimator=gae", "critic.model.lora_rank=4", "critic.optim.lr=1e-3",
             "actor_rollout_ref.model.lora.merge=True", "actor_rollout_ref.rollout.calculate_log_probs=True",
             "+algorithm/rollout_correction=bypass_ppo_clip", "actor_rollout_ref.actor.use_kl_loss=True",
             "actor_rollout_ref.actor.kl_loss_coef=0.1", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
             "trainer.total_training_steps=2", "trainer.save_freq=2"]
    run = prepared("lora_ppo_merged_bypass", *extra)
    assert run.plan.specs.actor_rollout_ref.ref_in_actor and run.plan.specs.critic.critic.lora.rank == 4
    with training_session(run) as trainer:
        assert trainer.old_log_probs.mode == "rollout"
        passes = []
        original = trainer.workers.actor_rollout.compute_log_prob
        trainer.workers.actor_rollout.compute_log_prob = lambda *a, **k: passes.append(1) or original(*a, **k)
        metrics = trainer.fit()
    assert passes == []  # the rollout's log-probs are the old policy
    for key in ("critic/vf_loss", "critic/grad_norm", "actor/pg_loss", "rollout_corr/k3_kl"):
        assert key in metrics and math.isfinite(metrics[key]), key
    assert metrics["critic/grad_norm"] > 0
    assert metrics["rollout/sync_check/mean_abs_diff"] < 1e-4 < metrics["rollout/sync_check/adapter_effect"]
    # one mini-batch: every row is trained by the policy that sampled it, so the rollout's log-probs and
    # the update's agree as exactly as the engines do, and the correction's KL is ~0
    assert metrics["training/rollout_actor_log_prob_diff/max"] < 1e-3
    assert abs(metrics["rollout_corr/kl"]) < 1e-4
    assert metrics["actor/kl_loss"] > 0  # step 2: the adapter of step 1 against the base (adapter off)
    model_bytes = _dir_bytes(run.cfg.actor_rollout_ref.model.path)
    critic_ckpt = os.path.join(str(tmp_path), "lora_ppo_merged_bypass", "global_step_2", "critic")
    assert 0 < _dir_bytes(critic_ckpt) < model_bytes / 2


def test_a_run_whose_adapter_never_reaches_the_rollout_stops_naming_the_cause(tiny_task, tmp_path):
    # The HF rollout (start_trainer's default) holds its own copy of the model, so a dropped adapter
    # leaves it serving the base weights, as a dropped vLLM load would; a vLLM start-up here would only
    # add ~25 s: vLLM's side of the check (it tells the served adapter from the base) is asserted above.
    path = run_dir(tmp_path, "broken_sync")
    env = {"PYTHONPATH": os.pathsep.join([BROKEN_SYNC, os.environ.get("PYTHONPATH", "")])}
    # one worker: the check runs on each rank's own rollout, a second rank would only repeat it
    proc = start_trainer(tiny_task, path, *LORA, "trainer.total_training_steps=4", "trainer.n_gpus_per_node=1",
                         "ray_init.num_cpus=1", env=env)
    with killed_on_exit(proc):
        _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == EXIT_WORKER_FAILED, stderr[-3000:]
    reason = last_line(stderr)
    assert "weight sync check failed" in reason, stderr[-3000:]
    assert "the rollout is sampling from the base model, the trained adapter did not reach it" in reason
