"""Few-step GRPO and PPO runs through the whole driver loop (PPO/GAE on tool-agent conversations), and
exact resume from a checkpoint."""

import json
import os
import re
import shutil

import pytest
import torch

from ballast.trainer.algorithms import masked_whiten
from testkit.agent import build_tool_calling_model
from testkit.e2e import STEP_METRICS, WITH_ROLLOUT_LOG_PROBS, assert_finite

MONITOR = re.compile(r"DynamicBatchMonitor: dp_rank_[01] - avg_tokens=\d+, max_tokens=\d+, min_tokens=\d+, "
                     r"batch_count=\d+")


def test_grpo_run_trains_and_reports_every_metric(session, tmp_path, capfd):
    extra = ["trainer.balance_keep_groups=True", "trainer.enable_monitor=True", "trainer.monitor_interval=2",
             "actor_rollout_ref.actor.dynamic_bsz_bucketing=True", "actor_rollout_ref.actor.bucket_boundaries=[16,24]",
             "actor_rollout_ref.actor.grad_clip_adaptive=True", "actor_rollout_ref.actor.grad_clip_min_batch_size=16",
             "trainer.cpus_per_worker=2"]
    with session("grpo", *extra) as trainer:
        before = trainer.workers.actor_rollout.actor_state_fingerprint()[0]
        metrics = trainer.fit()
        after = trainer.workers.actor_rollout.actor_state_fingerprint()[0]
        # each worker kept its two threads through the vLLM engine's start-up and the steps
        assert [p["threads"] for p in trainer.workers.actor_rollout.placement()] == [2, 2]
    assert_finite(metrics, STEP_METRICS + ["perf/micro_batch_tokens/avg", "perf/micro_batch_tokens/max",
                                        "perf/micro_batch_tokens/min", "balance/rank_0/tokens", "balance/rank_1/tokens"])
    # adaptive clipping: 8 samples per mini-batch < grad_clip_min_batch_size=16 halves grad_clip=1.0
    assert metrics["actor/grad_clip_effective"] == pytest.approx(0.5)
    assert metrics["perf/micro_batch_tokens/max"] <= 128  # the hard token cap (ppo_max_token_len_per_gpu)
    captured = capfd.readouterr()
    out = captured.out + captured.err
    assert len(MONITOR.findall(out)) == 4, out[-2000:]  # steps 1 and 2, both DP ranks
    assert "DeviceMeshBalancer: dp_rank_0 assigned 8 samples" in out
    plots = os.listdir(os.path.join(tmp_path, "grpo", "dynamic_batch_plots"))
    assert {"rank_load.png", "micro_batch_tokens_step_2.png", "sample_lengths_step_2.png"} <= set(plots)
    assert before != pytest.approx(after, rel=1e-9, abs=0), "actor parameters did not change"
    rows = [json.loads(line) for line in open(os.path.join(tmp_path, "grpo", "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2]
    assert os.path.isfile(os.path.join(tmp_path, "grpo", "charts", "balance_step_1.png"))


def test_ppo_run_on_tool_conversations_with_critic_gae_and_verls_separate_old_log_prob_pass(session, tmp_path):
    # tool-agent conversations [calculator call | tool response, mask 0 | call] from the tiny model
    # rewired to call the calculator on every turn (random models never call tools), trained with GAE;
    # with the shortcut off (old_log_prob_from_update=False) the old log-probs come from verl's separate
    # forward pass before the update, as verl computes them; the rollout's own log-probs check each row
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: calculator\n    config: {type: native, timeout_s: 5}\n")
    agent = [f"actor_rollout_ref.model.path={build_tool_calling_model(tmp_path / 'model')}",
             "actor_rollout_ref.rollout.mode=async", "actor_rollout_ref.rollout.multi_turn.enable=True",
             "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
             f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
             "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2"]
    extra = ["algorithm.adv_estimator=gae", "actor_rollout_ref.actor.use_dynamic_bsz=False",
             "actor_rollout_ref.rollout.calculate_log_probs=True", "actor_rollout_ref.actor.old_log_prob_from_update=False",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
             "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu=2",
             "critic.optim.lr=1e-3", "actor_rollout_ref.actor.use_kl_loss=True",
             "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
             # whole replicas (the CPU configs' setting): actor and critic train under DDP, the
             # reference is a frozen plain module; the other runs here shard with FSDP2
             "actor_rollout_ref.actor.fsdp_config.fsdp_size=1", "critic.fsdp_config.fsdp_size=1"]
    with session("ppo", *extra, *agent) as trainer:
        assert trainer.old_log_probs.mode == "pass"
        trained = []  # the batch of each critic update: what the driver computed for the step
        update_critic = trainer.workers.critic.update_critic
        trainer.workers.critic.update_critic = lambda batch, plan: trained.append(batch) or update_critic(batch, plan)
        metrics = trainer.fit()
    assert_finite(metrics, [k for k in STEP_METRICS if k != "perf/num_micro_batches"] + [
        "critic/vf_loss", "critic/vf_clipfrac", "critic/values/mean", "critic/returns/mean", "critic/grad_norm",
        "actor/kl_loss", "timing_s/values", "timing_s/ref", "timing_s/update_critic", "perf/mfu/actor_infer",
        "training/rollout_actor_log_prob_diff/max"])
    assert metrics["training/rollout_actor_log_prob_diff/max"] < 1e-3
    assert len(trained) == 2 and metrics["agent/tool_calls/total"] > 0
    for batch in trained:
        _assert_every_turn_is_credited_with_the_score(batch)


def _assert_every_turn_is_credited_with_the_score(batch):
    """GAE over [turn | tool response (mask 0) | turn]: with gamma = lam = 1 (verl's defaults) every
    sampled token's return is its conversation's score (the values telescope), the first turn's too (a
    tool response is no episode end), and the advantages are the whitened returns minus values."""
    mask = batch["response_mask"].bool()
    assert (mask[:, 1:] & ~mask[:, :-1]).any(dim=1).all()  # every response has a turn after a tool response
    first_turn = mask.long().cumprod(dim=1).bool()
    score = batch["token_level_rewards"].sum(dim=1, keepdim=True).expand_as(mask)
    assert (score[:, 0] > 0).all()  # the repeat task's partial credit: the next check is not 0 == 0
    torch.testing.assert_close(batch["returns"][mask], score[mask])
    expected = masked_whiten((batch["returns"] - batch["values"]) * mask, mask)
    torch.testing.assert_close(batch["advantages"], expected, rtol=1e-4, atol=1e-5)
    assert (batch["advantages"][first_turn] != 0).all()


COMPARED = ["critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/entropy",
            "response_length/mean", "global_seqlen/balanced_max"]


def test_resume_continues_exactly_like_an_uninterrupted_run(session, tmp_path, rollout_log_probs_run):
    straight = rollout_log_probs_run["final"]  # the same config, three steps without a stop
    # the shared run's step-2 checkpoint, alone in a run directory of its own (a copy: the shared run
    # stays as it is for its other users), is where this run stopped
    ckpt_root = os.path.join(tmp_path, "resumed")
    shutil.copytree(os.path.join(rollout_log_probs_run["dir"], "global_step_2"), os.path.join(ckpt_root, "global_step_2"))
    with open(os.path.join(ckpt_root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2")
    exported = os.path.join(ckpt_root, "global_step_2", "actor_hf")
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(exported) is not None  # the checkpoint's HF export loads
    # a save that crashed half-way must not be picked up
    os.makedirs(os.path.join(ckpt_root, ".tmp_global_step_3", "actor"))
    with session("resumed", *WITH_ROLLOUT_LOG_PROBS, "trainer.total_training_steps=3", "trainer.resume_mode=auto") as trainer:
        assert trainer.resumed_from is not None and trainer.global_step == 2
        resumed = trainer.fit()
    assert straight["balance/actor_plan/num_micro_batches"] >= 1  # the updates ran the driver's central plan
    for key in COMPARED:
        assert resumed[key] == pytest.approx(straight[key], rel=1e-5, abs=1e-7), key


def test_two_mini_batch_step_takes_the_first_ones_old_log_probs_from_the_update(rollout_log_probs_run):
    # two mini-batches: the update runs a forward-only pass over the second one before its first step; the first one's
    # old log-probs come back from the update and every row's are checked against the rollout's own
    assert rollout_log_probs_run["mode"] == "partial"
    metrics = rollout_log_probs_run["final"]
    assert_finite(metrics, STEP_METRICS + ["training/rollout_actor_log_prob_diff/mean",
                                        "training/rollout_actor_log_prob_diff/max", "perf/mfu/actor_infer"])
    assert metrics["actor/entropy"] > 0
    # a row mapped to the wrong sample, or left at its placeholder, would be off by whole nats
    assert metrics["training/rollout_actor_log_prob_diff/max"] < 1e-3


SHARED_SAME = ["critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/grad_norm", "actor/ppo_kl",
               "critic/advantages/max", "training/rollout_actor_log_prob_diff/max"]


def test_shared_prompts_train_exactly_like_the_rows_run_apart(session, rollout_log_probs_run):
    # The shared run (its step 2) against the e2e tests' shared plain run, same config otherwise: two
    # mini-batches, so the old log-probs come from the update's first mini-batch and a forward-only
    # pass over the second, both planned over prompts.
    plain = next(row for row in rollout_log_probs_run["rows"] if row["step"] == 2)
    with session("shared", *WITH_ROLLOUT_LOG_PROBS, "trainer.total_training_steps=2",
                 "actor_rollout_ref.actor.use_prefix_grouper=True") as trainer:
        shared = trainer.fit()
    for key in SHARED_SAME:
        assert shared[key] == pytest.approx(plain[key], rel=1e-5, abs=1e-6), key
    # each prompt ran once for its 4 samples: fewer tokens than the rows hold (prompts are 10-20 tokens)
    assert shared["balance/actor_plan/shared_token_fraction"] < 0.9
    assert shared["perf/micro_batch_tokens/max"] <= 128
