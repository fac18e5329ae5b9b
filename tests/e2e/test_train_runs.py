"""Few-step GRPO runs through the whole driver loop, and exact resume from a checkpoint. (PPO/GAE on
tool-agent conversations with verl's separate old-log-prob pass: row 0 of tests/e2e/test_rollout_matrix.py.)"""

import json
import os
import re
import shutil

import pytest

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
