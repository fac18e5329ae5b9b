"""Split resource pools (trainer.v1.trainer_mode=separate_async): a trainer group without a rollout and a
rollout-only group on a pool of its own, the weights crossing through Ray's object store after every
step. Zero batches ahead keeps the rollout on the trainer's current weights at every step (here with a
LoRA adapter merged into the weights it sends, and two local updates per step). (One batch ahead,
resume and a broken transfer: test_split_pools_ahead.py, which runs in the other test stream.)"""

import json
import os

import pytest
import torch

from ballast.engine.checkpoint import ENGINE_STATE_FILE

from testkit.e2e import SPLIT_POOLS as SPLIT
from testkit.e2e import WITH_ROLLOUT_LOG_PROBS

STALENESS = "training/off_policy/trajectory_staleness/max"


def _rows(path):
    return [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]


def test_split_pools_sample_with_the_trainers_weights_lora_merged_included(session, tmp_path, capfd):
    # the actor trains a LoRA adapter; what crosses to the rollout pool is the base weights with the
    # adapter merged in, through the same bucketed transfer as whole weights (which the one-batch-ahead
    # runs of test_split_pools_ahead.py and test_partial_rollouts.py send). Two local updates per step
    # (verl's parameter_sync_step=2, one mini-batch of 2 prompts each): the weights cross once per step,
    # after both, and the learning-rate schedule counts local updates (warmup over 4 of them).
    lora = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
            "actor_rollout_ref.actor.optim.lr=2e-2"]
    local = ["actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.v1.separate_async.parameter_sync_step=2",
             "actor_rollout_ref.actor.optim.lr_warmup_steps=4", "trainer.save_freq=3"]
    k0 = [*SPLIT, *WITH_ROLLOUT_LOG_PROBS, *lora, *local, "trainer.v1.separate_async.num_warmup_batches=0",
          "trainer.total_training_steps=3"]
    with session("k0", *k0) as trainer:
        assert trainer.workers.rollout is not None and trainer.workers.actor_rollout.world_size == 1
        assert not trainer.correction.bypass  # nothing is stale
        assert trainer.overlap.local_updates == 2 and not trainer.overlap.partial_rollout  # nothing in flight
        trainer.fit()
    assert "(merged with the LoRA adapter)" in capfd.readouterr().out
    rows = _rows(os.path.join(tmp_path, "k0"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # every batch came from the weights being trained: the transfer ran before each generation
        assert r["rollout_corr/k3_kl"] < 1e-6, r["rollout_corr/k3_kl"]
        assert r["rollout/sync_check/mean_abs_diff"] < 1e-5 and r["timing_s/export_weights"] > 0
        assert STALENESS not in r
    # the step's last local update ran at warmup factor (2 x step) / 4: two scheduler steps per step
    assert [r["actor/lr"] for r in rows] == pytest.approx([2e-2 * 2 / 4, 2e-2, 2e-2])
    state = torch.load(os.path.join(tmp_path, "k0", "global_step_3", "actor", ENGINE_STATE_FILE), weights_only=False)
    assert state["scheduler"]["last_epoch"] == 3 * 2  # scheduler steps: steps x local updates
    assert state["counters"]["global_step"] == 3 * 2  # optimizer steps: one mini-batch per local update
